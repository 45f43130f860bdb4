"""CTranslate2 as a peer in our benchmarks: the same fairseq checkpoint, the same inputs.

CTranslate2 is not a dependency of fairseq-stream; it is the ``bench`` extra
(``pip install -e .[bench]``). This module converts a fairseq checkpoint with
CTranslate2's own fairseq converter (once, cached on disk) and translates the
benchmark's fairseq batches with it, so that its outputs can be scored and
compared exactly like ours.

What the converter needed here (ctranslate2 4.8.5, fairseq-fixed 0.12.3.1,
torch 2.13): only the checkpoint loading. ``FairseqConverter._load`` calls
``torch.load(path, weights_only=True)`` itself, which torch >= 2.6 refuses for
every fairseq checkpoint (they pickle ``argparse.Namespace``). The project's
``trusted_checkpoints()`` cannot help there: it only affects fairseq-stream's
own loader (``fairseq_stream.checkpoint.load_state``), which the converter
never calls. Instead of the converter's ``unsafe_deserialization=True`` (the
full unpickler) we give its ``torch.load`` the project's allow-list,
``FAIRSEQ_SAFE_GLOBALS``, through ``torch.serialization.safe_globals``, after
checking the file with ``load_state`` (so a checkpoint with any other pickled
global is refused with the project's one-line message). The rest of the
converter (legacy ``Namespace`` args in ``cfg["model"]``, ``setup_task``,
``build_model``) works unchanged with fairseq-fixed.
"""

import json
import os
import shutil
import tempfile

import torch

# fairseq's default rule, which our BeamDecoder and fairseq's SequenceGenerator
# both use here: max_len = max_len_a * src_len + max_len_b with a = 0, b = 200,
# i.e. at most 200 tokens before the EOS (fairseq forces EOS at step 200).
# CTranslate2 has no per-source-length term; its max_decoding_length counts
# tokens without the end token (checked: a limit of 3 returns 3 tokens and no
# EOS), so 200 is the same bound. min_decoding_length=1 is fairseq's
# min_len=1 (no empty output).
MAX_LEN_B = 200
MIN_LEN = 1


def import_ctranslate2():
    """The ctranslate2 module, or None with the reason it cannot be used."""
    try:
        import ctranslate2
    except ImportError as e:
        return None, "ctranslate2 is not installed ({}); pip install -e .[bench]".format(e)
    return ctranslate2, None


def _stamp(checkpoint, ct2_version):
    st = os.stat(checkpoint)
    return {"checkpoint": os.path.realpath(checkpoint), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctranslate2": ct2_version}


def default_dir(checkpoint):
    """The cache next to the checkpoint: ``checkpoint_best.pt`` -> ``checkpoint_best.ct2``."""
    return os.path.splitext(checkpoint)[0] + ".ct2"


def converted_model(checkpoint, data_dir, out_dir=None, log=print):
    """A CTranslate2 model directory for ``checkpoint``, converted now unless cached and current.

    The cache is reused only if it was written from this very file (path,
    size, modification time) by this ctranslate2 version (``source.json``).
    """
    import ctranslate2
    from ctranslate2.converters import FairseqConverter

    from fairseq_stream.checkpoint import FAIRSEQ_SAFE_GLOBALS, load_state

    out_dir = out_dir or default_dir(checkpoint)
    stamp = _stamp(checkpoint, ctranslate2.__version__)
    stamp_file = os.path.join(out_dir, "source.json")
    if os.path.exists(stamp_file):
        with open(stamp_file) as f:
            if json.load(f) == stamp:
                return out_dir
    log("converting {} with CTranslate2 {}'s FairseqConverter into {}".format(
        checkpoint, ctranslate2.__version__, out_dir))
    load_state(checkpoint)  # the project's check: refuses pickled globals beyond the allow-list
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = tempfile.mkdtemp(prefix=".ct2-", dir=parent)
    try:
        # See the module docstring: the converter's own torch.load(weights_only=True)
        # needs fairseq's Namespace allowed; exactly the project's allow-list, no more.
        with torch.serialization.safe_globals(list(FAIRSEQ_SAFE_GLOBALS)):
            FairseqConverter(checkpoint, data_dir).convert(tmp, force=True)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump(stamp, f)
        # Written aside and moved into place: an interrupted conversion never
        # leaves a half-written model that a later run would take as cached.
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return out_dir


class CT2Peer:
    """Translate fairseq batches with a converted model, one CTranslate2 call per batch.

    Args:
        model_dir: what :func:`converted_model` returned.
        device: ``cpu`` or ``cuda``.
        src_dict, tgt_dict: the fairseq task's dictionaries (the converter
            copied their symbols, in order, into the model's vocabulary).
        compute_type: CTranslate2's ``compute_type`` (``float32``, ``int8``,
            ``int16`` ...): the converted float32 weights are quantized at load.
    """

    def __init__(self, model_dir, device, src_dict, tgt_dict, compute_type="float32"):
        import ctranslate2

        # One thread, as our side (intra: threads per batch; inter: batches in parallel).
        self.translator = ctranslate2.Translator(model_dir, device=device, compute_type=compute_type,
                                                 intra_threads=1, inter_threads=1)
        self.compute_type = compute_type
        self.device = device
        self.src_dict, self.tgt_dict = src_dict, tgt_dict

    def inputs(self, batches):
        """Each batch's sentences as source pieces: the fairseq source dictionary's symbols.

        The pieces come from the binarized ids our decoders read, so both sides
        see the same source (an out-of-vocabulary piece is ``<unk>`` on both).
        The trailing EOS is left out: the converted model adds it itself
        (``add_source_eos`` in its config).
        """
        d = self.src_dict
        out = []
        for sample in batches:
            src = sample["net_input"]["src_tokens"].cpu()
            pieces = [[d[t] for t in row.tolist() if t not in (d.pad(), d.eos())] for row in src]
            out.append((sample["id"].tolist(), pieces))
        return out

    def translate(self, inputs, beam):
        """Raw CTranslate2 results per batch (timed by the caller; :meth:`tokens` converts them)."""
        return [
            (ids, self.translator.translate_batch(
                pieces, beam_size=beam, max_batch_size=0, max_decoding_length=MAX_LEN_B,
                min_decoding_length=MIN_LEN))
            for ids, pieces in inputs
        ]

    def tokens(self, results):
        """sentence id -> best hypothesis as target-dictionary ids, like our outputs (EOS appended)."""
        d = self.tgt_dict
        out = {}
        for ids, batch in results:
            for sid, result in zip(ids, batch):
                out[sid] = torch.tensor([d.index(p) for p in result.hypotheses[0]] + [d.eos()], dtype=torch.long)
        return out
