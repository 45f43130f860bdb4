"""Safe loading of fairseq checkpoints under torch's ``weights_only`` unpickler.

Since torch 2.6, ``torch.load`` refuses every pickled global that is not on an
allow-list, and fairseq checkpoints carry a few (``argparse.Namespace`` for
argparse-style checkpoints and legacy architectures, plus some containers).
fairseq itself still calls ``torch.load`` without an allow-list, so on torch
2.13 every fairseq checkpoint fails to load.

We allow exactly the globals fairseq checkpoints need and nothing more. A
checkpoint that needs anything else is refused with an error naming the
global; a user who trusts the file opts in explicitly for that file
(``--trust-checkpoint`` on the command line, ``trust=True`` in Python), which
loads it with the full unpickler. There is no process-wide switch.
"""

import argparse
import collections
import logging
import os
import pickle
import re
from typing import Iterable

import torch

from fairseq_stream.errors import UnsafeCheckpointError

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

_trusted_paths = set()
_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w\.]+)")


def _key(path):
    return os.path.realpath(path)


def trust_checkpoints(paths: Iterable[str]):
    """Mark exactly these checkpoint files as trusted (loaded without the allow-list)."""
    for path in paths:
        _trusted_paths.add(_key(path))


def is_trusted(path):
    """Whether the user explicitly trusted this checkpoint file."""
    return _key(path) in _trusted_paths


def load_state(path, trust=False):
    """``torch.load`` a checkpoint file on CPU, safely unless ``trust`` or trusted by path.

    Raises:
        UnsafeCheckpointError: the file needs a global outside the allow-list.
    """
    trusted = trust or is_trusted(path)
    with open(path, "rb") as f:
        if trusted:
            logger.warning("loading trusted checkpoint %s with the full unpickler", path)
            return torch.load(f, map_location=torch.device("cpu"), weights_only=False)
        try:
            with torch.serialization.safe_globals(list(FAIRSEQ_SAFE_GLOBALS)):
                return torch.load(f, map_location=torch.device("cpu"), weights_only=True)
        except pickle.UnpicklingError as e:
            match = _UNSUPPORTED_GLOBAL.search(str(e))
            offending = match.group(1) if match else "an unsupported object"
            raise UnsafeCheckpointError(
                "refusing to load checkpoint {}: it contains the pickled global "
                "'{}', which fairseq checkpoints do not need and which could run "
                "code when loaded. If you trust this file, pass {} (Python: "
                "trust=True) to load it anyway.".format(path, offending, TRUST_FLAG)
            ) from None


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
