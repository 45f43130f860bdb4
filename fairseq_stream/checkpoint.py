"""Safe loading of fairseq checkpoints under torch's ``weights_only`` unpickler.

Since torch 2.6, ``torch.load`` refuses every pickled global that is not on an
allow-list, and fairseq checkpoints carry a few (``argparse.Namespace`` for
argparse-style checkpoints and legacy architectures, plus some containers).
fairseq itself still calls ``torch.load`` without an allow-list, so on torch
2.13 every fairseq checkpoint fails to load.

We allow exactly the globals fairseq checkpoints need and nothing more. A
checkpoint that needs anything else is refused with an error naming the
global; a user who trusts the file opts in explicitly for that file
(``--trust-checkpoint`` on the command line, ``trust_checkpoint=True`` in
:class:`fairseq_stream.api.Translator`), which loads it with the full
unpickler. There is no process-wide switch: trust is given to the file as it
is at that moment (its inode, size and modification time), so a file
replaced or rewritten at the same path afterwards is checked again, and the
Python API trusts a file for its own load only.

Files that are not checkpoints (missing, truncated, not a torch file, not a
fairseq checkpoint) stop with a one-line error naming the file.
"""

import argparse
import collections
import contextlib
import logging
import os
import pickle
import re
from typing import Iterable, Sequence

import torch

from fairseq_stream.errors import CheckpointError, UnsafeCheckpointError

logger = logging.getLogger(__name__)

# What fairseq's own checkpoints pickle besides tensors and builtin containers:
# argparse-style checkpoints store ``args`` as a Namespace, and cfg-style ones
# store a Namespace in ``cfg.model``/``cfg.task`` for legacy (add_args)
# architectures such as ``lstm``. Training state adds OrderedDicts, and
# ``collections.defaultdict`` appears in some optimizer/meter states.
FAIRSEQ_SAFE_GLOBALS = (
    argparse.Namespace,
    collections.OrderedDict,
    collections.defaultdict,
)

TRUST_FLAG = "--trust-checkpoint"

# realpath -> the file's identity when it was trusted
_trusted = {}
_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w\.]+)")


def _identity(path):
    """What distinguishes this file from a replacement at the same path, or None if unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def trust_checkpoints(paths: Iterable[str]):
    """Trust exactly these checkpoint files, as they are now (loaded without the allow-list)."""
    for path in paths:
        _trusted[os.path.realpath(path)] = _identity(path)


def untrust_checkpoints(paths: Iterable[str]):
    """Withdraw the trust :func:`trust_checkpoints` gave these files."""
    for path in paths:
        _trusted.pop(os.path.realpath(path), None)


@contextlib.contextmanager
def trusted_checkpoints(paths: Sequence[str]):
    """Trust these files for the loads made inside the ``with`` block only."""
    paths = list(paths)
    trust_checkpoints(paths)
    try:
        yield
    finally:
        untrust_checkpoints(paths)


def is_trusted(path):
    """Whether the user explicitly trusted this checkpoint file, and it is still the same file."""
    identity = _trusted.get(os.path.realpath(path))
    return identity is not None and identity == _identity(path)


def check_readable(path):
    """Raise a one-line :class:`CheckpointError` if ``path`` is not a readable file."""
    if not path:
        # fairseq splits --path on ':' and keeps the empty names a stray ':' leaves.
        raise CheckpointError("--path has an empty checkpoint name (a ':' at its start or end, or '::')")
    if not os.path.exists(path):
        raise CheckpointError("checkpoint {} does not exist".format(path))
    if os.path.isdir(path):
        raise CheckpointError("checkpoint {} is a directory, not a checkpoint file".format(path))
    if not os.access(path, os.R_OK):
        raise CheckpointError("checkpoint {} is not readable (permission denied)".format(path))


def load_state(path, trust=False):
    """``torch.load`` a checkpoint file on CPU, safely unless ``trust`` or trusted by path.

    Raises:
        UnsafeCheckpointError: the file needs a global outside the allow-list.
        CheckpointError: the file is missing, unreadable, or not a torch
            checkpoint (truncated, corrupt, some other kind of file).
    """
    check_readable(path)
    trusted = trust or is_trusted(path)
    try:
        with open(path, "rb") as f:
            if trusted:
                logger.warning("loading trusted checkpoint %s with the full unpickler", path)
                state = torch.load(f, map_location=torch.device("cpu"), weights_only=False)
            else:
                with torch.serialization.safe_globals(list(FAIRSEQ_SAFE_GLOBALS)):
                    state = torch.load(f, map_location=torch.device("cpu"), weights_only=True)
    except pickle.UnpicklingError as e:
        match = _UNSUPPORTED_GLOBAL.search(str(e))
        if match is None:
            raise CheckpointError(_not_a_checkpoint(path, e)) from None
        raise UnsafeCheckpointError(
            "refusing to load checkpoint {}: it contains the pickled global "
            "'{}', which fairseq checkpoints do not need and which could run "
            "code when loaded. If you trust this file, pass {} (Python: "
            "trust_checkpoint=True) to load it anyway.".format(path, match.group(1), TRUST_FLAG)
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError, IndexError, KeyError, TypeError,
            AttributeError, UnicodeDecodeError) as e:
        # What torch raises for a truncated zip archive, a text file, or a
        # pickle of something else depends on the bytes: all mean "not a checkpoint".
        raise CheckpointError(_not_a_checkpoint(path, e)) from None
    if not isinstance(state, dict) or "model" not in state or not ("cfg" in state or "args" in state):
        raise CheckpointError(
            "{} is a torch file but not a fairseq checkpoint (fairseq checkpoints are dicts with "
            "'model' and 'cfg' or 'args'; found {})".format(path, _describe(state)))
    return state


def _not_a_checkpoint(path, error):
    """Why ``torch.load`` failed on ``path``, told from the file's first bytes, not torch's text."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK\x03\x04"):
        what = "it is a torch zip archive that is truncated or corrupt"
    elif head[:1] == b"\x80":
        what = "it is a pickle that is truncated, corrupt or not a torch checkpoint"
    else:
        what = "it is not a torch checkpoint file"
    return "cannot load checkpoint {} ({} bytes): {} ({})".format(
        path, size, what, type(error).__name__)


def _describe(state):
    if isinstance(state, dict):
        return "a dict with keys {}".format(sorted(map(str, state))[:6])
    return "a {}".format(type(state).__name__)


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """Drop-in for ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` using :func:`load_state`.

    Everything after the unpickling is fairseq's own code path (argument
    overrides, cfg re-creation, state-dict upgrades), so old argparse-style
    and new cfg-style checkpoints come out exactly as fairseq makes them.
    """
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager
    from omegaconf import OmegaConf

    local_path = PathManager.get_local_path(path)
    if local_path != path and PathManager.path_requires_pathmanager(path):
        # Same as fairseq: refresh a possibly stale cached copy of a remote file.
        try:
            os.remove(local_path)
        except FileNotFoundError:
            pass
        if load_on_all_ranks:
            torch.distributed.barrier()
        local_path = PathManager.get_local_path(path)

    state = load_state(local_path, trust=is_trusted(path))

    if state.get("args") is not None and arg_overrides is not None:
        for arg_name, arg_val in arg_overrides.items():
            setattr(state["args"], arg_name, arg_val)

    if state.get("cfg") is not None:
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
        if arg_overrides is not None:
            checkpoint_utils.overwrite_args_by_name(state["cfg"], arg_overrides)

    return checkpoint_utils._upgrade_state_dict(state)


# torch's load_state_dict error, one entry per parameter: "size mismatch for KEY: copying a param with shape
# torch.Size([612, 16]) from checkpoint, the shape in current model is torch.Size([608, 16])."
_SIZE_MISMATCH = re.compile(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) "
                            r"from checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)")


def size_mismatch_error(error: Exception, paths: Sequence[str]):
    """A one-line :class:`CheckpointError` for torch's multi-line "size mismatch" ``error``, raised where a
    checkpoint of ``paths`` does not fit the model fairseq built for it; None for any other error.

    The usual cause is a data directory whose dictionaries are not the ones
    the checkpoint was trained with (another ensemble member's, or a
    dictionary with words added): the embedding tables then have another
    number of rows. The file is found by reading the parameter's shape in
    each checkpoint again (this runs only on the error's path).
    """
    found = _SIZE_MISMATCH.search(str(error))
    if not isinstance(error, RuntimeError) or found is None:
        return None
    key, saved, built = found.group(1), _shape(found.group(2)), _shape(found.group(3))
    culprit = next((p for p in paths if _saved_shape(p, key) == saved), None)
    named = "checkpoint {}".format(culprit) if culprit else "a checkpoint of --path"
    message = "{} does not fit the model built for it: its {} is {}, the model's {}".format(
        named, key, "x".join(map(str, saved)), "x".join(map(str, built)))
    if "embed_tokens" in key or "output_projection" in key:
        message += ("; the data directory's dictionary has {} words and the checkpoint's {}: give the data "
                    "directory (the dictionaries) it was trained with".format(built[0], saved[0]))
    return CheckpointError(message)


def _shape(text: str):
    return tuple(int(n) for n in text.split(",") if n.strip())


def _saved_shape(path: str, key: str):
    try:
        tensor = load_checkpoint_to_cpu(path)["model"].get(key)
    except Exception:  # noqa: BLE001 - only naming the file is at stake here; the error is raised anyway
        return None
    return tuple(tensor.shape) if tensor is not None else None
