"""The fused output layer (fairseq_stream.ops) against its torch reference, on every available backend.

How results are compared (``assert_matches``), the same for every backend:

* values position by position: the same -inf entries, finite ones within
  ``TOL`` (float32: 2e-5 + 2e-6 |value|, a few units in the last place of
  a score, since the kernels' exp/log and summation order differ from
  torch's; float64: 1e-12 + 1e-14 |value|);
* every returned index is distinct and the reference's own score at that
  index equals the returned value (same tolerance): each (value, word) pair is
  right, not just the list of values;
* indices equal the reference's, position by position, except where the
  reference's value there is tied with a neighbour in its full ranking (within
  twice ``TOL``, or both -inf): ``torch.topk`` orders ties arbitrarily and
  rounding can make near-ties swap.

The compiled backends' own tie rule (equal values: lower index first) is
checked exactly on tied logits. The CUDA kernels run on a GPU where there is
one (tests marked ``cuda``); without one their logic still runs here in a host
emulation of the block model (``csrc/cuda_emu``), compiled with the system C++
compiler. Everything is seeded, on the CPU, one thread.
"""

import ctypes
import math
from pathlib import Path

import pytest
import torch

from conftest import cuda_emulation_library, sorted_batches
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import loader
from fairseq_stream.ops import output_layer as ol
from fairseq_stream.ops import auto_backend, available_backends, greedy_log_softmax, topk_log_softmax

TOL = {torch.float32: (2e-5, 2e-6), torch.float64: (1e-12, 1e-14)}  # (absolute, relative)
PAD, EOS, UNK = 1, 2, 3

HAS_CPU = "cpu" in available_backends()
HAS_CUDA_DEVICE = torch.cuda.is_available()
needs_cpu = pytest.mark.skipif(
    not HAS_CPU, reason="fairseq_stream._ops_cpu is not built (python setup.py build_ext --inplace)")
needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA_DEVICE, reason="needs a CUDA device"),
    pytest.mark.skipif(HAS_CUDA_DEVICE and "cuda" not in available_backends(),
                       reason="fairseq_stream._ops_cuda is not built (python setup.py build_ext --inplace)"),
]
COMPILED = [pytest.param("cpu", marks=needs_cpu), pytest.param("cuda", marks=needs_cuda)]


def device_of(backend):
    return "cuda" if backend == "cuda" else "cpu"


def random_logits(gen, rows, V, dtype=torch.float32, device="cpu", scale=3.0, neg_inf=0.05):
    """Gaussian logits with some -inf entries (as a model's masked words)."""
    x = torch.randn(rows, V, generator=gen, dtype=torch.float64) * scale
    x[torch.rand(rows, V, generator=gen) < neg_inf] = -math.inf
    return x.to(dtype).to(device)


def every_rule(gen, rows, dtype, device):
    """Options that switch every rule on: unk penalty, per-row ban/force of EOS, a per-row score."""
    return dict(
        pad=PAD, eos=EOS, unk=UNK, unk_penalty=0.7,
        ban_eos=(torch.rand(rows, generator=gen) < 0.3).to(device),
        force_eos=(torch.rand(rows, generator=gen) < 0.2).to(device),
        add=(torch.randn(rows, generator=gen, dtype=torch.float64) * 10).to(dtype).to(device),
    )


def reference_scores(logits, **kw):
    """The reference's full (rows, V) scores (rules applied, before topk) and its EOS column."""
    members = [logits] if isinstance(logits, torch.Tensor) else list(logits)
    bias = kw.pop("bias", None)
    biases = [None] * len(members) if bias is None else ([bias] if isinstance(bias, torch.Tensor) else list(bias))
    args = dict(unk=None, unk_penalty=0.0, temperature=1.0, ban_eos=None, force_eos=None, add=None)
    args.update(kw)
    return ol._reference_scores(members, biases, args.pop("pad"), args.pop("eos"), **args)


def close(a, b, tol):
    """Equal -inf pattern; finite entries within tol = (absolute, relative to b)."""
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
        return False
    fin = ~torch.isneginf(a)
    return bool(((a[fin] - b[fin]).abs() <= tol[0] + tol[1] * b[fin].abs()).all())


def assert_matches(got, logits, n, **kw):
    """``got`` (an OutputLayerResult) equals the reference's top n (see the module docstring)."""
    scores, eos = reference_scores(logits, **kw)
    scores, eos = scores.cpu(), eos.cpu()
    tol = TOL[scores.dtype]
    rows, V = scores.shape
    values, indices = got.values.cpu(), got.indices.cpu()
    assert values.shape == indices.shape == (rows, n)
    assert values.dtype == scores.dtype and indices.dtype == torch.long
    assert got.eos.shape == (rows,) and close(got.eos, eos, tol), "EOS log-probabilities differ"
    ref_values, ref_indices = scores.topk(min(n + 1, V), dim=1)
    assert close(values, ref_values[:, :n], tol), "values differ from the reference's top n"
    assert bool(((indices >= 0) & (indices < V)).all())
    assert bool((indices.sort(dim=1).values.diff(dim=1) > 0).all()), "an index is returned twice"
    assert close(scores.gather(1, indices), values, tol), "a returned value is not its word's reference value"
    # Positions whose reference value is tied with a neighbour in the full ranking.
    ranked = ref_values.double()
    gaps = (ranked[:, 1:] - ranked[:, :-1]).abs()
    near = (gaps <= 2 * (tol[0] + tol[1] * ranked[:, 1:].abs())) | gaps.isnan()
    tied = torch.isneginf(ranked).clone()
    tied[:, 1:] |= near
    tied[:, :-1] |= near
    tied = tied[:, :n]
    differ = (indices != ref_indices[:, :n]) & ~tied
    assert not differ.any(), "indices differ at untied positions: rows {}".format(
        differ.any(dim=1).nonzero().flatten().tolist()[:10])


# (rows, V, n, models, dtype): small and large vocabularies, every n, ensembles; the big
# combinations sparingly (the reference itself is the slow part).
CASES = [
    (7, 17, 1, 1, torch.float32),
    (7, 17, 10, 1, torch.float64),
    (7, 17, 17, 2, torch.float32),
    (33, 8000, 1, 1, torch.float32),
    (33, 8000, 10, 1, torch.float64),
    (33, 8000, 100, 1, torch.float32),
    (33, 8000, 200, 1, torch.float32),
    (33, 8000, 10, 2, torch.float32),
    (33, 8000, 200, 4, torch.float64),
    (5, 42000, 1, 1, torch.float32),
    (5, 42000, 10, 2, torch.float32),
    (5, 42000, 100, 4, torch.float32),
    (5, 42000, 200, 1, torch.float64),
    (1, 42000, 200, 2, torch.float32),
    (3000, 300, 10, 1, torch.float32),
]


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("rows,V,n,models,dtype", CASES)
def test_random_logits_with_every_rule(backend, rows, V, n, models, dtype):
    device = device_of(backend)
    gen = torch.Generator().manual_seed(rows * 7919 + V * 31 + n * 7 + models)
    members = [random_logits(gen, rows, V, dtype, device) for _ in range(models)]
    logits = members[0] if models == 1 else members
    kw = every_rule(gen, rows, dtype, device)
    assert_matches(topk_log_softmax(logits, n, backend=backend, **kw), logits, n, **kw)
    plain = dict(pad=PAD, eos=EOS)
    assert_matches(topk_log_softmax(logits, n, backend=backend, **plain), logits, n, **plain)


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("models", [2, 4, 8])
def test_members_that_disagree(backend, models):
    """Each word's best member ahead of the others by 0 to 10 (across the CPU kernel's bound tiers, which
    skip most words there): the ensemble's top words and values are the reference's."""
    device = device_of(backend)
    gen = torch.Generator().manual_seed(17 + models)
    rows, V = 16, 6000
    owner = torch.randint(0, models, (rows, V), generator=gen)
    lead = torch.rand(rows, V, generator=gen) * 10
    members = []
    for m in range(models):
        x = torch.randn(rows, V, generator=gen) * 2
        members.append(torch.where(owner == m, x + lead, x).to(device))
    for n in (1, 10, 50):
        kw = dict(pad=PAD, eos=EOS)
        assert_matches(topk_log_softmax(members, n, backend=backend, **kw), members, n, **kw)


@pytest.mark.parametrize("backend", COMPILED)
def test_spoilt_and_sparse_rows(backend):
    """NaN, +inf, all -inf, one finite word, forced and banned EOS on one row: as torch (all -inf where NaN)."""
    device = device_of(backend)
    gen = torch.Generator().manual_seed(5)
    for V, n in ((17, 10), (9000, 200)):
        x = random_logits(gen, 8, V)
        x[0, 5] = math.nan
        x[1, 6] = math.inf
        x[2] = -math.inf
        x[3] = -math.inf
        x[3, 9] = 0.5
        x[4, EOS] = -math.inf
        x = x.to(device)
        force = torch.tensor([0, 0, 0, 0, 0, 1, 1, 0], dtype=torch.bool, device=device)
        ban = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool, device=device)
        kw = dict(pad=PAD, eos=EOS, unk=UNK, unk_penalty=-2.0, force_eos=force, ban_eos=ban,
                  add=torch.randn(8, generator=gen).to(device))
        got = topk_log_softmax(x, n, backend=backend, **kw)
        assert_matches(got, x, n, **kw)
        assert bool(torch.isneginf(got.values[[0, 1, 2, 6]]).all())
        ens = [x, random_logits(gen, 8, V).to(device)]
        assert_matches(topk_log_softmax(ens, n, backend=backend, **kw), ens, n, **kw)


@pytest.mark.parametrize("backend", COMPILED)
def test_bias_temperature_and_ban_everywhere(backend):
    device = device_of(backend)
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        members = [random_logits(gen, 9, 5000, dtype, device) for _ in range(2)]
        bias = [torch.randn(5000, generator=gen).to(dtype).to(device), None]
        for logits, b in ((members[0], bias[0]), (members, bias)):
            kw = dict(pad=PAD, eos=EOS, temperature=0.7, bias=b, ban_eos=True, unk=0, unk_penalty=1.5)
            assert_matches(topk_log_softmax(logits, 12, backend=backend, **kw), logits, 12, **kw)


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_logits(backend, dtype):
    """float16/bfloat16 logits (fp16 models): rounded as torch rounds them, log-probabilities in float32."""
    device = device_of(backend)
    gen = torch.Generator().manual_seed(3)
    logits = random_logits(gen, 6, 3000, dtype, device)
    for temperature in (1.0, 0.6):
        kw = dict(pad=PAD, eos=EOS, temperature=temperature, add=torch.randn(6, generator=gen).to(device))
        got = topk_log_softmax(logits, 50, backend=backend, **kw)
        assert got.values.dtype == torch.float32
        assert_matches(got, logits, 50, **kw)


@pytest.mark.parametrize("backend", COMPILED)
def test_ties_come_in_index_order(backend):
    """The compiled backends' tie rule, exactly: equal values, lower word index first."""
    device = device_of(backend)
    gen = torch.Generator().manual_seed(2)
    for V, n in ((40, 10), (9000, 200)):
        const = torch.zeros(3, V, device=device)
        got = topk_log_softmax(const, n, pad=PAD, eos=EOS, backend=backend)
        expected = [w for w in range(V) if w != PAD][:n]
        assert got.indices.tolist() == [expected] * 3
        ints = torch.randint(0, 3, (4, V), generator=gen).float().to(device)
        got = topk_log_softmax(ints, n, pad=PAD, eos=EOS, unk=UNK, unk_penalty=1.0, backend=backend)
        assert_matches(got, ints, n, pad=PAD, eos=EOS, unk=UNK, unk_penalty=1.0)
        v, i = got.values.cpu(), got.indices.cpu()
        in_order = (v[:, :-1] > v[:, 1:]) | ((v[:, :-1] == v[:, 1:]) & (i[:, :-1] < i[:, 1:]))
        assert bool(in_order.all())


@pytest.mark.parametrize("backend", ["torch"] + COMPILED)
def test_greedy_variant(backend):
    device = device_of(backend)
    gen = torch.Generator().manual_seed(4)
    logits = random_logits(gen, 20, 8000, device=device)
    kw = dict(pad=PAD, eos=EOS, unk=UNK, unk_penalty=0.5)
    greedy = greedy_log_softmax(logits, backend=backend, **kw)
    assert greedy.values.shape == greedy.indices.shape == greedy.eos.shape == (20,)
    assert_matches(type(greedy)(greedy.values[:, None], greedy.indices[:, None], greedy.eos), logits, 1, **kw)
    scores, _ = reference_scores(logits, **kw)
    assert torch.equal(greedy.indices.cpu(), scores.argmax(dim=1).cpu())


def decoder_logits(models, task, rows=64):
    """Each model's logits for real decoder rows: teacher-forced prefixes of the test set's references."""
    batch = sorted_batches(task, size=8, limit=8)[0]
    out = []
    with torch.no_grad():
        for model in models:
            enc = model.encoder(batch["net_input"]["src_tokens"], src_lengths=batch["net_input"]["src_lengths"])
            logits, _ = model.decoder(batch["net_input"]["prev_output_tokens"], encoder_out=enc)
            out.append(logits.reshape(-1, logits.size(-1))[:rows].contiguous())
    return out


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_real_logits_from_the_toy_models(loaded, backend, name):
    models, task = loaded(name)
    d = task.target_dictionary
    members = [x.to(device_of(backend)) for x in decoder_logits(models, task)]
    logits = members[0] if len(members) == 1 else members
    rows = members[0].size(0)
    gen = torch.Generator().manual_seed(6)
    kw = every_rule(gen, rows, torch.float32, device_of(backend))
    kw.update(pad=d.pad(), eos=d.eos(), unk=d.unk())
    for n in (1, 5, 10, 100):
        assert_matches(topk_log_softmax(logits, n, backend=backend, **kw), logits, n, **kw)
    # float64 copies of the logits: the tight tolerance
    wide = [x.double() for x in members]
    wide = wide[0] if len(wide) == 1 else wide
    kw["add"] = kw["add"].double()
    assert_matches(topk_log_softmax(wide, 10, backend=backend, **kw), wide, 10, **kw)


def test_torch_backend_is_the_decoders_arithmetic():
    """The reference is bitwise the sequence BeamDecoder applies to fairseq's log-probabilities."""
    gen = torch.Generator().manual_seed(8)
    rows, V = 12, 300
    members = [random_logits(gen, rows, V) for _ in range(2)]
    force = torch.rand(rows, generator=gen) < 0.3
    add = torch.randn(rows, generator=gen)
    lp = torch.logsumexp(torch.stack([torch.log_softmax(x, -1, dtype=torch.float32) for x in members]), 0) - math.log(2)
    lp[:, PAD] = -math.inf
    lp[:, UNK] -= 0.5
    eos_col = lp[:, EOS].clone()
    lp.add_(torch.full_like(eos_col, -0.0).masked_fill_(force, -math.inf).unsqueeze(1))
    lp[:, EOS] = eos_col
    lp[:, EOS] = -math.inf
    values, indices = torch.topk((lp + add[:, None]).nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf), 7, dim=1)
    got = topk_log_softmax(members, 7, pad=PAD, eos=EOS, unk=UNK, unk_penalty=0.5, force_eos=force,
                           ban_eos=True, add=add, backend="torch")
    assert torch.equal(got.values, values) and torch.equal(got.indices, indices)


def test_backend_choice_and_missing_extension(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    logits = random_logits(gen, 4, 100)
    assert available_backends()[0] == "torch"
    assert auto_backend("cpu") == ("cpu" if HAS_CPU else "torch")
    assert auto_backend("cuda", n=201) == "torch"
    # Without the compiled modules: auto falls back to torch; asking for one is a one-line error.
    monkeypatch.setattr(loader, "_EXTENSIONS", {"cpu": None, "cuda": None})
    monkeypatch.setattr(loader, "_MISSING", {"cpu": "No module named 'fairseq_stream._ops_cpu'"})
    assert available_backends() == ["torch"]
    assert auto_backend("cpu") == "torch"
    got = topk_log_softmax(logits, 5, pad=PAD, eos=EOS)
    assert_matches(got, logits, 5, pad=PAD, eos=EOS)
    with pytest.raises(FairseqStreamError) as err:
        topk_log_softmax(logits, 5, pad=PAD, eos=EOS, backend="cpu")
    message = str(err.value)
    assert "\n" not in message and "not built" in message and "build_ext --inplace" in message


@needs_cpu
def test_backend_device_mismatch_is_one_line():
    if HAS_CUDA_DEVICE:
        pytest.skip("the message is for CPU tensors sent to the CUDA backend on a machine without one")
    with pytest.raises(FairseqStreamError) as err:
        topk_log_softmax(torch.zeros(2, 10), 3, pad=PAD, eos=EOS, backend="cuda")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad,error", [
    (dict(logits=torch.zeros(3)), ValueError),
    (dict(logits=torch.zeros(3, 10, dtype=torch.long)), TypeError),
    (dict(logits=[torch.zeros(3, 10), torch.zeros(3, 11)]), ValueError),
    (dict(logits=[]), TypeError),
    (dict(n=0), ValueError),
    (dict(n=11), ValueError),
    (dict(pad=10), ValueError),
    (dict(eos=PAD), ValueError),
    (dict(unk=EOS), ValueError),
    (dict(temperature=0.0), ValueError),
    (dict(ban_eos=torch.zeros(3)), ValueError),
    (dict(force_eos=torch.zeros(4, dtype=torch.bool)), ValueError),
    (dict(add=torch.zeros(3, 1)), ValueError),
    (dict(bias=torch.zeros(9)), ValueError),
    (dict(backend="gpu"), ValueError),
])
def test_argument_checks(bad, error):
    args = dict(logits=torch.zeros(3, 10), n=4, pad=PAD, eos=EOS)
    args.update(bad)
    logits, n = args.pop("logits"), args.pop("n")
    with pytest.raises(error):
        topk_log_softmax(logits, n, **args)


def test_empty_batch():
    for backend in available_backends():
        if backend == "cuda":
            continue
        got = topk_log_softmax(torch.zeros(0, 10), 3, pad=PAD, eos=EOS, backend=backend)
        assert got.values.shape == (0, 3) and got.indices.shape == (0, 3) and got.eos.shape == (0,)


# --- the CUDA kernels' logic without a GPU -------------------------------------------------

CSRC = Path(ol.__file__).resolve().parent / "csrc"
EMU_SOURCES = [CSRC / "cuda" / "output_layer_cuda.cu", CSRC / "cuda" / "output_layer_cuda.h",
               CSRC / "cuda" / "accumulate.h"] + sorted((CSRC / "cuda_emu").glob("*"))


@pytest.fixture(scope="session")
def cuda_emulation():
    """csrc/cuda_emu's host build of the CUDA output layer's kernels, via ctypes."""
    return cuda_emulation_library("cuda-emu", "emulate_output_layer.cpp", EMU_SOURCES, "c++20")


def emulated(lib, logits, n, multiprocessors, pad, eos, unk=None, unk_penalty=0.0, temperature=1.0,
             ban_eos=None, force_eos=None, add=None, bias=None):
    """The CUDA kernels' answer, computed by the emulation (float32/float64 CPU tensors)."""
    members = [x.contiguous() for x in ([logits] if isinstance(logits, torch.Tensor) else logits)]
    rows, V = members[0].shape
    dtype = members[0].dtype
    values = torch.empty(rows, n, dtype=dtype)
    indices = torch.empty(rows, n, dtype=torch.long)
    eos_out = torch.empty(rows, dtype=dtype)
    keep = list(members)
    ptrs = lambda ts: (ctypes.c_void_p * len(ts))(*[t.data_ptr() if t is not None else None for t in ts])  # noqa: E731
    biases = [] if bias is None else [b.contiguous() for b in ([bias] if isinstance(bias, torch.Tensor) else bias)]
    keep += biases
    opt = {}
    for name, t in (("ban", ban_eos), ("force", force_eos), ("add", add)):
        opt[name] = t.to(dtype if name == "add" else torch.bool).contiguous() if isinstance(t, torch.Tensor) else None
        keep.append(opt[name])
    rc = lib.fs_emulate_output_layer(
        {torch.float32: 0, torch.float64: 1}[dtype], len(members), ctypes.c_long(rows), V, n, ptrs(members),
        ptrs(biases or [None] * len(members)), int(bool(biases)), ctypes.c_double(temperature), pad, eos,
        -1 if unk is None else unk, ctypes.c_double(unk_penalty), int(ban_eos is True),
        *[ctypes.c_void_p(opt[k].data_ptr() if opt[k] is not None else None) for k in ("ban", "force", "add")],
        ctypes.c_void_p(values.data_ptr()), ctypes.c_void_p(indices.data_ptr()), ctypes.c_void_p(eos_out.data_ptr()),
        multiprocessors)
    assert rc == 0
    return ol.OutputLayerResult(values, indices, eos_out)


def test_cuda_kernels_in_host_emulation(cuda_emulation):
    """One block per row and rows split over several blocks + merge, ensembles, every rule, ties, overflow.

    ``multiprocessors`` steers the split: 1 keeps one block per row, 80
    splits these few rows over the vocabulary. The emulation's temperature is
    a multiplication by the reciprocal (torch's CUDA division), so the cases
    here use none.
    """
    gen = torch.Generator().manual_seed(12)
    cases = [(3, 300, 10, 1, torch.float32), (2, 9000, 200, 1, torch.float32), (2, 9000, 10, 2, torch.float64),
             (1, 9000, 100, 4, torch.float32)]
    for rows, V, n, models, dtype in cases:
        members = [random_logits(gen, rows, V, dtype) for _ in range(models)]
        members[0][0, 7] = math.nan
        logits = members[0] if models == 1 else members
        for kw in (every_rule(gen, rows, dtype, "cpu"), dict(pad=PAD, eos=EOS)):
            for sms in (1, 80):
                assert_matches(emulated(cuda_emulation, logits, n, sms, **kw), logits, n, **kw)
    # Equal keys everywhere: the candidate buffer overflows and is sorted mid-row; index order.
    const = torch.zeros(2, 9000)
    for sms in (1, 80):
        got = emulated(cuda_emulation, const, 200, sms, pad=PAD, eos=EOS)
        assert got.indices.tolist() == [[w for w in range(201) if w != PAD]] * 2
    bias = torch.randn(9000, generator=gen)
    got = emulated(cuda_emulation, const, 20, 80, pad=PAD, eos=EOS, bias=bias, ban_eos=True)
    assert_matches(got, const, 20, pad=PAD, eos=EOS, bias=bias, ban_eos=True)
