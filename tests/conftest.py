"""Shared fixtures: toy checkpoints trained once per machine and cached, CLI runners."""

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# One torch thread in every test process, whichever test modules are collected: the tools the tests start
# run with OMP_NUM_THREADS=1 (tool_env), and a score compared bit for bit with theirs must come from the same
# thread count. (Modules set it at import, so `pytest tests/test_bulk_edges.py` alone ran on every core and
# its comparison with fairseq-generate's scores failed on a 2-core machine.)
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def load_script(name, path):
    """The Python file ``path`` imported as module ``name`` (a script's ``__main__`` part does not run)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_setup():
    """setup.py imported as a module (its setup() call runs only as __main__)."""
    return load_script("fairseq_stream_setup", REPO / "setup.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` are skipped unless asked for (``-m slow``, or FAIRSEQ_STREAM_SLOW=1 for all):
    the default suite is CI's, which must stay under its time on a fresh 2-core machine."""
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get("FAIRSEQ_STREAM_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow, or FAIRSEQ_STREAM_SLOW=1 for the whole suite")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# scripts/toy_cache.py: the one place that decides where the toy is cached (shared with the quickstart).
toy_cache = load_script("toy_cache", REPO / "scripts" / "toy_cache.py")
CSRC = REPO / "fairseq_stream" / "ops" / "csrc"


def pointers(tensors):
    """A ctypes array of the tensors' data pointers (None stays a null pointer): the emulated kernels' inputs."""
    import ctypes

    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def cuda_emulation_library(name, main, sources, std):
    """CUDA kernels built for the host against ``csrc/cuda_emu`` (``main``: the entry file there, which
    includes the .cu), via ctypes; cached per hash of ``sources`` in the toy's cache folder, one build at a
    time across pytest's workers. Skips where there is no C++ compiler or it lacks ``std``."""
    import ctypes
    import fcntl
    import hashlib

    digest = hashlib.sha1(b"".join(Path(p).read_bytes() for p in sources)).hexdigest()[:12]
    base = toy_cache.cache_base()  # XDG_CACHE_HOME honoured
    lib = base / "{}-{}.so".format(name, digest)
    base.mkdir(parents=True, exist_ok=True)
    with open(str(lib) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            tmp = lib.with_suffix(".tmp{}".format(os.getpid()))
            cmd = [os.environ.get("CXX", "c++"), "-std=" + std, "-O1", "-shared", "-fPIC", "-I",
                   str(CSRC / "cuda_emu"), "-I", str(CSRC / "cuda"), str(CSRC / "cuda_emu" / main), "-o", str(tmp)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:
                pytest.skip("no C++ compiler for the CUDA emulation: {}".format(e))
            if proc.returncode != 0:
                if "std=" + std in proc.stderr or "bit_cast" in proc.stderr:
                    pytest.skip("the C++ compiler lacks {}: {}".format(std, proc.stderr.splitlines()[0]))
                raise AssertionError("the CUDA kernels do not compile for the emulation:\n" + proc.stderr[-4000:])
            tmp.rename(lib)
    return ctypes.CDLL(str(lib))
warm_tools = load_script("warm_tools", Path(__file__).resolve().parent / "warm_tools.py")


@dataclass
class Toy:
    """Paths of the toy task built by ``scripts/train_toy.sh``."""

    root: Path

    @property
    def data_bin(self):
        return self.root / "data-bin"

    @property
    def raw(self):
        return self.root / "raw"

    @property
    def transformer(self):
        return self.root / "transformer" / "checkpoint_best.pt"

    @property
    def transformer2(self):
        return self.root / "transformer2" / "checkpoint_best.pt"

    @property
    def transformer3(self):
        return self.root / "transformer3" / "checkpoint_best.pt"

    @property
    def transformer4(self):
        return self.root / "transformer4" / "checkpoint_best.pt"

    @property
    def lstm(self):
        return self.root / "lstm" / "checkpoint_best.pt"


def tool_env():
    """Environment for subprocesses: this venv's tools first, one thread, repo importable."""
    env = dict(os.environ)
    env["PATH"] = "{}{}{}".format(BIN, os.pathsep, env.get("PATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="session")
def toy():
    """The toy checkpoints; trained on first use (deterministic), then reused from the cache.

    The cache (scripts/toy_cache.py: $FAIRSEQ_STREAM_CACHE, else
    $XDG_CACHE_HOME/fairseq-stream, else ~/.cache/fairseq-stream) is the one
    scripts/quickstart.sh trains into and copies toy/ from, so the suite and
    the quickstart train once between them. Test workers (pytest-xdist) and
    parallel runs share it: a file lock lets the first one train while the
    others wait for it.
    """
    return Toy(toy_cache.ensure())


def run_tool(argv, cwd=REPO, check=True, input=None, env=None):
    """Run a command-line tool from this venv; return the CompletedProcess (text).

    ``env`` adds to (or overrides) :func:`tool_env`.
    """
    argv = [str(a) for a in argv]
    if not os.path.isabs(argv[0]) and (BIN / argv[0]).exists():
        argv[0] = str(BIN / argv[0])
    proc = None
    if not env and warm_tools.warm_argv(argv, BIN):  # forked from a process that has imported fairseq
        proc = warm_tools.run(argv, cwd, tool_env(), input=input)
    if proc is None:
        proc = subprocess.run(
            argv, cwd=cwd, env=dict(tool_env(), **(env or {})), capture_output=True, text=True, input=input
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            "{} failed ({}):\n{}\n{}".format(" ".join(argv), proc.returncode, proc.stdout[-3000:], proc.stderr[-5000:])
        )
    return proc


# Plain fairseq-generate, unpatched, as a user on torch < 2.6 would run it: the
# only change is torch.load's old default, applied to these test-owned files.
PLAIN_FAIRSEQ_GENERATE = (
    "import functools, torch; "
    "torch.load = functools.partial(torch.load, weights_only=False); "
    "from fairseq_cli.generate import cli_main; cli_main()"
)


def run_plain_fairseq_generate(args, **kwargs):
    """fairseq-generate without the plugin (reference output)."""
    return run_tool([sys.executable, "-c", PLAIN_FAIRSEQ_GENERATE] + list(args), **kwargs)


def hypotheses(stdout):
    """fairseq-generate's H-lines as {sentence id: (score, text)}; asserts no id repeats."""
    hyps = {}
    for line in stdout.splitlines():
        if line.startswith("H-"):
            head, score, text = (line.split("\t") + [""])[:3]
            sid = int(head[2:])
            assert sid not in hyps, "sentence {} printed twice".format(sid)
            hyps[sid] = (float(score), text)
    return hyps


@pytest.fixture(scope="session")
def loaded(toy):
    """``loaded(name)`` -> (models, task) for "transformer", "lstm", "ensemble" (2 transformers) or "ensemble4"
    (4), test and valid sets loaded."""
    from fairseq import checkpoint_utils

    cache = {}

    def load(name):
        if name not in cache:
            paths = {"transformer": [toy.transformer], "lstm": [toy.lstm],
                     "ensemble": [toy.transformer, toy.transformer2],
                     "ensemble4": [toy.transformer, toy.transformer2, toy.transformer3, toy.transformer4]}[name]
            models, _, task = checkpoint_utils.load_model_ensemble_and_task(
                [str(p) for p in paths], arg_overrides={"data": str(toy.data_bin)})
            for m in models:
                m.eval()
            task.load_dataset("test")
            task.load_dataset("valid")
            cache[name] = (models, task)
        return cache[name]

    return load


@pytest.fixture(scope="session")
def exact(loaded):
    """``exact(name)``: as ``loaded(name)``, float64 copies of the models, for exactness tests.

    fairseq still computes its attention softmax and output log-softmax in
    float32 whatever the model's dtype: float64 narrows float noise to about
    1e-7, it does not remove it.
    """
    import copy

    cache = {}

    def load(name):
        if name not in cache:
            models, task = loaded(name)
            cache[name] = ([copy.deepcopy(m).double() for m in models], task)
        return cache[name]

    return load


@pytest.fixture
def float64_fairseq(monkeypatch):
    """fairseq's softmax helpers in the input's dtype (fairseq: always float32), for one test.

    With it the fairseq runner's log-probabilities of float64 models are
    float64, as the lean runner's and the fused output layer's are.
    """
    import torch
    from fairseq import utils

    monkeypatch.setattr(utils, "softmax", lambda x, dim, onnx_trace=False: torch.softmax(x, dim=dim))
    monkeypatch.setattr(utils, "log_softmax", lambda x, dim, onnx_trace=False: torch.log_softmax(x, dim=dim))


# Our searches as BeamDecoder options, for tests that run each of them.
DECODER_OPTIONS = {
    "greedy": dict(beam_size=1),
    "fixed": dict(beam_size=5, finalize="fairseq"),
    "fixed-stay": dict(beam_size=5, finalize="stay"),
    "var-batch": dict(beam_size=5, finalize="stay", pruning_ap=1.5, pruning_mc=5),
    "var-fairseq": dict(beam_size=5, finalize="fairseq", pruning_ap=1.5, pruning_mc=5),
}


def decoder_options(search):
    """``DECODER_OPTIONS[search]`` as BeamDecoder keyword arguments (a fresh Pruning)."""
    from fairseq_stream.search.pruning import Pruning

    opts = dict(DECODER_OPTIONS[search])
    ap, mc = opts.pop("pruning_ap", None), opts.pop("pruning_mc", None)
    if ap is not None or mc is not None:
        opts["pruning"] = Pruning(ap=ap, mc=mc)
    return opts


def sorted_batches(task, size, limit, subset="test"):
    """fairseq's length-sorted batches of ``subset``, sentences with id < limit only."""
    dataset = task.dataset(subset)
    # disable_iterator_cache: the session's task is shared, and fairseq hands back the iterator
    # another test made, whatever its max_sentences (a batch size of 6 got 8s).
    itr = task.get_batch_iterator(dataset=dataset, max_sentences=size, required_batch_size_multiple=1,
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    ids = [i for b in itr for i in b["id"].tolist() if i < limit]
    return [dataset.collater([dataset[i] for i in ids[j:j + size]]) for j in range(0, len(ids), size)]


def decode(dec, models, batches, scheduler):
    """{sentence id: n-best} of ``dec`` over ``batches``, by batch (``scheduler`` None) or a StreamPool(**scheduler)."""
    import torch
    from fairseq_stream.schedule.pool import StreamPool

    out = {}
    with torch.no_grad():
        if scheduler is None:
            for s in batches:
                out.update(zip(s["id"].tolist(), dec.generate(models, s)))
        else:
            pool = StreamPool(dec, **scheduler)
            for sid, hyps in pool.run(dec.open(s["net_input"], ids=s["id"]) for s in batches):
                assert sid not in out
                out[sid] = hyps
    return out


def differences(ref, ours, tolerance=1e-9):
    """Sentences whose n-best lists differ in tokens, or in scores by more than ``tolerance``."""
    import torch

    assert sorted(ref) == sorted(ours), "not every sentence came out exactly once"
    bad = []
    for sid in ref:
        a, b = ref[sid], ours[sid]
        same = len(a) == len(b) and all(
            torch.equal(x["tokens"], y["tokens"])
            and abs(float(x["score"]) - float(y["score"])) <= tolerance
            and torch.allclose(x["positional_scores"], y["positional_scores"], rtol=0, atol=tolerance)
            for x, y in zip(a, b))
        if not same:
            bad.append(sid)
    return bad


def parse_generate_args(argv):
    """fairseq-generate's command line parsed in this process, as the tool parses it (plugin included).

    Raises SystemExit where the tool would exit (argparse's one-line errors go to stderr).
    """
    from fairseq import options

    parser = options.get_generation_parser()
    return options.parse_args_and_arch(parser, input_args=[str(a) for a in argv])


def generate_in_process(argv):
    """Run fairseq-generate's ``main`` in this process; its output goes to ``sys.stdout`` (use capsys).

    The same code path as the command line tool without paying ~3 s of
    imports per run; the tests of the tool's own process behaviour (exit
    codes, one-line errors, the wrappers) still run it as a subprocess.
    """
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli.generate import main

    return main(convert_namespace_to_omegaconf(parse_generate_args(argv)))


def full_state(path):
    """Read a test-owned checkpoint with the full unpickler (to derive variants from it)."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def unsafe_copy(toy, path):
    """The toy transformer saved at ``path`` with one pickled global outside the allow-list."""
    import datetime

    import torch

    state = full_state(toy.transformer)
    state["extra_state"]["note"] = datetime.date(2020, 1, 1)  # pickled as GLOBAL datetime.date
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path
