"""The fused output layer: (bias +) log-softmax + search rules + top-n per row, in one call.

Today each decoder step materializes the full-vocabulary log-probabilities
(fairseq: ``log_softmax(logits / temperature, dtype=float32)``; an ensemble of M
models: ``logsumexp(stack(lprobs_m)) - log(M)``), applies the search's rules to
them and then takes ``topk`` per row: four or five passes over rows x V. Since
adding a row's cumulative score does not change the row's ranking, the search
only needs each row's best n (value, word) with the rules applied, which the
compiled backends find in one or two passes over the logits (Marian's fused
kernel, Algorithms 2 and 3 of "Faster Neural Machine Translation Inference"):

* an online max/sum pass per model and row gives that model's normalizer
  (log-sum-exp) without storing log-probabilities;
* for one model, the top n by logit is the top n by log-probability, so the
  same pass keeps the n best logits behind a threshold; for an ensemble a
  second pass computes each word's ensemble log-probability from the M logits
  and the M normalizers (no M x rows x V tensor), skipping words whose best
  model log-probability is already below the threshold;
* only the n kept words get their log-probabilities computed.

Backends (``backend=``):

``torch``
    The reference: exactly today's arithmetic (``log_softmax``, ``logsumexp``,
    the rules as ``BeamDecoder`` applies them, ``topk``), on any device.
``cpu``
    ``fairseq_stream._ops_cpu`` (``csrc/cpu/output_layer_cpu.cpp``): AVX2
    one-pass online max/sum + threshold filter per row, OpenMP over rows (via
    ``at::parallel_for``, so ``torch.set_num_threads`` holds).
``cuda``
    ``fairseq_stream._ops_cuda`` (``csrc/cuda/``): one block per row, or a
    row split over several blocks with a merge kernel when rows are few;
    n <= 200; float16/bfloat16 logits read as they are.
``auto``
    :func:`auto_backend`: the compiled kernel for the tensors' device when it
    is built, else ``torch``.

Precision: the kernels compute in the log-probabilities' type (float32,
float64 for float64 logits) with their own ``exp``/``log`` and summation
order, so values differ from the reference's in the last bits: within 2e-5
in float32 and 1e-12 in float64 (tests/test_output_layer.py), while the
logits are rounded exactly as the reference rounds them (``+ bias`` and
``/ temperature`` in the logits' type; on CUDA, like torch there, as a
multiplication by the reciprocal). A row with a NaN or +inf logit, or with
no finite one, is -inf everywhere, as in the reference (whose log_softmax
is NaN on such a row).

Ties: the compiled backends order equal values by word index (lower first)
and are deterministic; ``torch.topk`` leaves the order of equal values
unspecified. So across backends indices are equal except among exactly tied
values, and among values closer than the rounding above. Rows with fewer
than n words of finite value are filled with ``-inf`` values at the lowest
word indices not already returned.
"""

import math
from typing import List, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops.loader import compiled_module, missing_reason

BACKENDS = ("auto", "torch", "cpu", "cuda")
CUDA_MAX_N = 200  # the CUDA kernel's candidate buffer (csrc/cuda/output_layer_cuda.h)
_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

class OutputLayerResult(NamedTuple):
    """Per row: the best n values (best first), their word indices, and the EOS log-probability.

    ``values`` (rows, n) are the log-probabilities after the rules, plus
    ``add`` when given; ``indices`` (rows, n) int64; ``eos`` (rows,) is the
    EOS column's log-probability after the rules (without ``add``), whether
    or not EOS is among the n best.
    """

    values: Tensor
    indices: Tensor
    eos: Tensor


def available_backends() -> List[str]:
    """The backends that can run here: always "torch", then "cpu" and "cuda" where built (and usable)."""
    names = ["torch"]
    if compiled_module("cpu") is not None:
        names.append("cpu")
    if torch.cuda.is_available() and compiled_module("cuda") is not None:
        names.append("cuda")
    return names


def auto_backend(device: Union[str, torch.device] = "cpu", n: Optional[int] = None) -> str:
    """The backend ``backend="auto"`` picks for tensors on ``device`` (and n per row): the fastest available.

    The CUDA kernel for CUDA tensors (n <= 200) and the CPU kernel for CPU
    tensors where they are built; ``torch`` otherwise (and for other devices).
    """
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cuda" and n is not None and n > CUDA_MAX_N:
        return "torch"
    if kind in ("cpu", "cuda") and compiled_module(kind) is not None:
        return kind
    return "torch"


def topk_log_softmax(logits: Union[Tensor, Sequence[Tensor]], n: int, *, pad: int, eos: int,
                     unk: Optional[int] = None, unk_penalty: float = 0.0, temperature: float = 1.0,
                     ban_eos: Union[None, bool, Tensor] = None, force_eos: Optional[Tensor] = None,
                     add: Optional[Tensor] = None, bias: Union[None, Tensor, Sequence[Optional[Tensor]]] = None,
                     backend: str = "auto", check: bool = True) -> OutputLayerResult:
    """Each row's n best (log-probability, word) with the search's rules applied.

    Computes, per row, what ``BeamDecoder`` computes from the decoder's
    logits, without the full log-probability matrix:

    1. ``lprobs = log_softmax((logits + bias) / temperature)`` in float32
       (float64 for float64 logits); for a list of M models' logits
       ``logsumexp(stack(lprobs_m), 0) - log(M)``;
    2. NaN -> -inf; ``lprobs[:, pad] = -inf``; ``lprobs[:, unk] -= unk_penalty``;
       rows with ``force_eos`` (at their maximum length): every column -inf
       except EOS; rows with ``ban_eos`` (below the minimum length): EOS = -inf;
    3. ``topk(lprobs + add[:, None], n)``.

    Args:
        logits: (rows, V) floating tensor (float16, bfloat16, float32 or float64), or a list of M such
            tensors of one shape, dtype and device (an ensemble: log of the mean of the models' probabilities).
        n: how many words per row, 1 <= n <= V.
        pad, eos: the pad and EOS word indices.
        unk, unk_penalty: ``unk_penalty`` is subtracted from the unk column.
        temperature: divides the logits (> 0), as fairseq's ``--temperature``.
        ban_eos: True (every row), or a (rows,) bool tensor: EOS gets -inf.
        force_eos: (rows,) bool tensor: every word but EOS gets -inf.
        add: (rows,) floating tensor added to each row's values (a hypothesis' cumulative score), cast to
            the values' type first; it does not change a row's ranking.
        bias: (V,) tensor added to the logits before the temperature (one per model for an ensemble: a
            list, entries may be None).
        backend: "auto", "torch", "cpu" or "cuda" (see the module docstring).
        check: validate the arguments. A decoder step that passes what it checked once may skip it: one
            sentence at a time, the checks cost about 17 us a call on one CPU thread, a third of the kernel.

    Returns:
        :class:`OutputLayerResult` ``(values (rows, n), indices (rows, n) int64, eos (rows,))``, values
        best first, in float32 (float64 for float64 logits). Equal values come in word-index order in the
        compiled backends; ``torch.topk``'s order among ties is unspecified.

    Raises:
        ValueError, TypeError: bad shapes, dtypes, devices or arguments.
        FairseqStreamError: the requested backend is not built, cannot run on the tensors' device, or
            (cuda) n > 200.
    """
    ban_eos = None if ban_eos is False else ban_eos
    force_eos = None if force_eos is False else force_eos
    if check:
        members, biases, _, _, out_dtype = _check(logits, n, pad, eos, unk, unk_penalty, temperature, ban_eos,
                                                   force_eos, add, bias)
    else:
        members, biases, _, _, out_dtype = _unchecked(logits, bias)
    name = _resolve(backend, members[0].device, n)
    if add is not None and add.dtype != out_dtype:
        add = add.to(out_dtype)
    if name == "torch":
        return _reference(members, biases, n, pad, eos, unk, unk_penalty, temperature, ban_eos, force_eos, add)
    return _compiled(name, members, biases, bias is not None, n, pad, eos, unk, unk_penalty, temperature,
                     ban_eos, force_eos, add, out_dtype)


def _unchecked(logits, bias):
    """What :func:`_check` returns, for arguments checked before: (members, biases, rows, V, out dtype)."""
    members = [logits] if isinstance(logits, Tensor) else list(logits)
    biases = [None] * len(members) if bias is None else [bias] if isinstance(bias, Tensor) else list(bias)
    rows, V = members[0].shape
    out_dtype = torch.float64 if members[0].dtype == torch.float64 else torch.float32
    return members, biases, rows, V, out_dtype


def _compiled(name, members, biases, has_bias, n, pad, eos, unk, unk_penalty, temperature, ban_eos, force_eos,
              add, out_dtype) -> OutputLayerResult:
    """The compiled backend ``name`` ("cpu" or "cuda") on checked arguments (``add`` in the output type)."""
    device = members[0].device
    rows, V = members[0].shape
    if rows == 0:
        return OutputLayerResult(
            torch.empty(0, n, dtype=out_dtype, device=device),
            torch.empty(0, n, dtype=torch.long, device=device),
            torch.empty(0, dtype=out_dtype, device=device),
        )
    if name == "cpu" and members[0].dtype not in (torch.float32, torch.float64):
        # The CPU kernel reads float32/float64: round as torch does (in the
        # input type) before widening, so results stay those of the reference.
        members = [_scaled(x, b, temperature).float() for x, b in zip(members, biases)]
        has_bias, biases = False, [None] * len(members)
        temperature = 1.0
    members = [x if x.is_contiguous() else x.contiguous() for x in members]
    bias_list = [] if not has_bias else [
        (b if b is not None else torch.zeros(V, dtype=x.dtype, device=device)).to(x.dtype).contiguous()
        for x, b in zip(members, biases)
    ]
    ban_all = ban_eos is True
    ban_rows = ban_eos.contiguous() if isinstance(ban_eos, Tensor) else None
    force_rows = force_eos.contiguous() if force_eos is not None else None
    values, indices, eos_out = compiled_module(name).topk_log_softmax(
        members, bias_list, int(n), int(pad), int(eos), -1 if unk is None else int(unk),
        float(unk_penalty), float(temperature), ban_all, ban_rows, force_rows,
        add.contiguous() if add is not None else None,
    )
    return OutputLayerResult(values, indices, eos_out)


def greedy_log_softmax(logits, **kwargs) -> OutputLayerResult:
    """:func:`topk_log_softmax` with n = 1, as (rows,) tensors: each row's best word and its value.

    Marian's Algorithms 2 and 3: the CPU kernel keeps a running argmax in the
    same pass as the online normalizer (one read of each row for one model);
    the CUDA kernel's filter threshold is then the row's max, so only the
    argmax (and exact ties) reach its candidate buffer. Only the chosen word's
    log-probability is computed. Takes the keyword arguments of
    :func:`topk_log_softmax`.
    """
    values, indices, eos = topk_log_softmax(logits, 1, **kwargs)
    return OutputLayerResult(values.squeeze(1), indices.squeeze(1), eos)


def _resolve(backend: str, device: torch.device, n: int) -> str:
    if backend not in BACKENDS:
        raise ValueError("backend must be one of {}, not {!r}".format(", ".join(BACKENDS), backend))
    if backend == "auto":
        return auto_backend(device, n)
    if backend == "torch":
        return backend
    if compiled_module(backend) is None:
        raise FairseqStreamError(
            "output-layer backend '{}' is not built (fairseq_stream._ops_{}: {}); build it with "
            "'python setup.py build_ext --inplace', or use backend 'auto' or 'torch'".format(
                backend, backend, missing_reason(backend)))
    if device.type != backend:
        raise FairseqStreamError(
            "output-layer backend '{}' cannot run on {} tensors; use backend 'auto'".format(backend, device.type))
    if backend == "cuda" and n > CUDA_MAX_N:
        raise FairseqStreamError(
            "output-layer backend 'cuda' keeps at most {} words per row, not {}; use backend 'auto'".format(
                CUDA_MAX_N, n))
    return backend


def _check(logits, n, pad, eos, unk, unk_penalty, temperature, ban_eos, force_eos, add, bias):
    """Validate the arguments (shapes, dtypes, devices; never tensor values, which would sync a GPU)."""
    members = [logits] if isinstance(logits, Tensor) else list(logits)
    if not members or not all(isinstance(x, Tensor) for x in members):
        raise TypeError("logits must be a tensor or a non-empty list of tensors")
    first = members[0]
    if first.dim() != 2:
        raise ValueError("logits must be (rows, V), got shape {}".format(tuple(first.shape)))
    if first.dtype not in _FLOAT_TYPES:
        raise TypeError("logits must be float16, bfloat16, float32 or float64, not {}".format(first.dtype))
    for x in members[1:]:
        if x.shape != first.shape or x.dtype != first.dtype or x.device != first.device:
            raise ValueError("an ensemble's logits must share shape, dtype and device: {} {} {} vs {} {} {}".format(
                tuple(x.shape), x.dtype, x.device, tuple(first.shape), first.dtype, first.device))
    rows, V = first.shape
    if V >= 2 ** 31 or len(members) > 64:
        raise ValueError("at most 2**31 - 1 words and 64 models")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= V:
        raise ValueError("n must be an int in [1, V={}], got {!r}".format(V, n))
    for name, value in (("pad", pad), ("eos", eos), ("unk", unk)):
        if value is None and name == "unk":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < V:
            raise ValueError("{} must be a word index in [0, {}), got {!r}".format(name, V, value))
    if pad == eos or unk in (pad, eos):
        raise ValueError("pad, eos and unk must be distinct words (got {}, {}, {})".format(pad, eos, unk))
    if not math.isfinite(unk_penalty):
        raise ValueError("unk_penalty must be finite")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError("temperature must be > 0 and finite, got {!r}".format(temperature))
    for name, t in (("ban_eos", ban_eos), ("force_eos", force_eos)):
        if t is None or (name == "ban_eos" and t is True):
            continue
        if not isinstance(t, Tensor) or t.shape != (rows,) or t.dtype != torch.bool or t.device != first.device:
            raise ValueError("{} must be{} a ({},) bool tensor on {}".format(
                name, " True or" if name == "ban_eos" else "", rows, first.device))
    if add is not None:
        if not isinstance(add, Tensor) or add.shape != (rows,) or not add.is_floating_point() \
                or add.device != first.device:
            raise ValueError("add must be a ({},) floating tensor on {}".format(rows, first.device))
    if bias is None:
        biases = [None] * len(members)
    else:
        biases = [bias] if isinstance(bias, Tensor) else list(bias)
        if len(biases) != len(members):
            raise ValueError("bias: one (V,) tensor (or None) per model, got {} for {} models".format(
                len(biases), len(members)))
        for b in biases:
            if b is not None and (not isinstance(b, Tensor) or b.shape != (V,) or not b.is_floating_point()
                                  or b.device != first.device):
                raise ValueError("bias must be a ({},) floating tensor on {}".format(V, first.device))
    out_dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
    return members, biases, rows, V, out_dtype


def _scaled(x: Tensor, bias: Optional[Tensor], temperature: float) -> Tensor:
    """``(x + bias) / temperature`` in ``x``'s type, as fairseq's runner rounds it."""
    if bias is not None:
        x = x + bias.to(x.dtype)
    if temperature != 1.0:
        x = x / temperature
    return x


def _reference(members, biases, n, pad, eos, unk, unk_penalty, temperature, ban_eos, force_eos, add):
    """The torch backend: today's arithmetic, in today's order (fairseq's runner + ``BeamDecoder``)."""
    scores, eos_out = _reference_scores(members, biases, pad, eos, unk, unk_penalty, temperature, ban_eos,
                                        force_eos, add)
    values, indices = torch.topk(scores, n, dim=1)
    return OutputLayerResult(values, indices, eos_out)


def apply_step_rules(lp: Tensor, pad: int, eos: int, unk: Optional[int] = None, unk_penalty: float = 0.0,
                     force_eos: Optional[Tensor] = None, ban_eos=False) -> Tensor:
    """fairseq's rules of a step on log-probabilities ``lp`` (rows, V), in place and in fairseq's order.

    PAD is never chosen; UNK loses ``unk_penalty``; rows in ``force_eos``
    (at their maximum length) may only end: -inf is added to them (-0.0,
    which changes nothing, to the others: no read of which rows those are,
    and faster than a broadcast masked_fill_), then the EOS column is put
    back; ``ban_eos`` (True, or a row mask: before ``--min-len``) forbids EOS.
    The beam decoder and the fused layer's reference both apply them here.
    """
    lp[:, pad] = -math.inf
    if unk is not None and unk_penalty:
        lp[:, unk] -= unk_penalty
    if force_eos is not None:
        eos_col = lp[:, eos].clone()
        lp.add_(torch.full_like(eos_col, -0.0).masked_fill_(force_eos, -math.inf).unsqueeze(1))
        lp[:, eos] = eos_col
    if ban_eos is True:
        lp[:, eos] = -math.inf
    elif isinstance(ban_eos, Tensor):
        lp[:, eos] = lp[:, eos].masked_fill(ban_eos, -math.inf)
    return lp


def _reference_scores(members, biases, pad, eos, unk, unk_penalty, temperature, ban_eos, force_eos, add):
    """The reference's (rows, V) scores before ``topk``, and its EOS column (also used by the tests)."""
    out_dtype = torch.float64 if members[0].dtype == torch.float64 else torch.float32
    lprobs = [torch.log_softmax(_scaled(x, b, temperature), dim=-1, dtype=out_dtype)
              for x, b in zip(members, biases)]
    if len(lprobs) == 1:
        lp = lprobs[0]
    else:
        lp = torch.logsumexp(torch.stack(lprobs, dim=0), dim=0) - math.log(len(lprobs))
    apply_step_rules(lp, pad, eos, unk, unk_penalty, force_eos, ban_eos)
    eos_out = lp[:, eos].nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    scores = lp.add_(add.to(out_dtype).unsqueeze(1)) if add is not None else lp
    scores.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    return scores, eos_out
