"""How a CPU decode uses the cores (issue 50): our kernels' own parallel loop, torch's ops on one thread.

No timing here (speed is benchmarks/bench_threads.py's): the collapse on a
busy core came from OpenMP regions whose waiting threads spin, so the tests
count them, and check how our loop splits work and that threads never
change a result.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO, hypotheses, run_tool, tool_env
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import threads
from fairseq_stream.ops.output_layer import compiled_module

module = compiled_module("cpu")
needs_kernels = pytest.mark.skipif(module is None or not hasattr(module, "set_kernel_threads"),
                                   reason="the compiled CPU kernels are not built")


@pytest.fixture
def kernel_threads():
    """Set our kernels' threads for one test (torch's ops on one thread, as a decode has them)."""
    before_torch = torch.get_num_threads()

    def use(n):
        module.set_kernel_threads(n)
        torch.set_num_threads(1)

    yield use
    module.set_kernel_threads(0)
    torch.set_num_threads(before_torch)


@needs_kernels
@pytest.mark.parametrize("threads_", [1, 2, 3, 8])
@pytest.mark.parametrize("n, grain", [(0, 1), (1, 1), (7, 1), (1000, 3), (100000, 64), (100000, 100000)])
def test_every_item_runs_once_whatever_the_threads(kernel_threads, threads_, n, grain):
    kernel_threads(threads_)
    total, wrong = module.parallel_sum_of_squares(n, grain)
    assert (total, wrong) == (sum(i * i for i in range(n)), 0)


@needs_kernels
def test_a_small_product_stays_on_the_calling_thread_and_a_large_one_is_shared(kernel_threads):
    """The split: a call with less than a chunk's worth of work never wakes a thread."""
    from fairseq_stream.ops import product as P

    kernel_threads(2)
    torch.manual_seed(0)
    weight = torch.randn(512, 256)
    product = P.linear(weight, None, "int8w8")
    _, shared_before, _ = module.parallel_counters()
    product(torch.randn(1, 256))
    _, shared_small, _ = module.parallel_counters()
    product(torch.randn(320, 256))
    _, shared_large, _ = module.parallel_counters()
    assert shared_small == shared_before, "one row's 131k multiply-adds woke a thread"
    assert shared_large == shared_small + 1, "320 rows' 42M multiply-adds ran on the caller alone"


def skip_without(gemm: str):
    """Skip where the float32 product, or ``gemm`` ("mkl", "onednn") for it, is not in this torch build."""
    from fairseq_stream.ops import product as P

    if not P.available():
        pytest.skip("MKL's packed sgemm is not in this torch build: " + P.missing_reason())
    if gemm == "onednn" and P.onednn_missing_reason():
        pytest.skip(P.onednn_missing_reason())


def float32_product(gemm: str, out_features: int, in_features: int, rows: int):
    """(weight, bias, rows x, the float32 Product on ``gemm``), Gaussian, seeded by ``rows``; skips where the
    GEMM is not in this torch build."""
    skip_without(gemm)
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(out_features, in_features), torch.randn(out_features), torch.randn(rows, in_features)
    return weight, bias, x, module.Product(weight, bias, "float32", kernel=gemm)


@needs_kernels
@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
@pytest.mark.parametrize("rows", [1, 5, 64, 65, 333])
def test_gemm_rows_split_over_threads_give_the_same_bits(kernel_threads, rows, gemm):
    """The float32 product's rows spread over our threads: the same bits as on one thread, MKL's GEMM or oneDNN's."""
    weight, bias, x, product = float32_product(gemm, 1024, 512, rows)
    kernel_threads(1)
    alone = product.gemm_product(x)
    for threads_ in (2, 3):
        kernel_threads(threads_)
        assert torch.equal(product.gemm_product(x), alone)


@needs_kernels
@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
@pytest.mark.parametrize("rows", [6, 20, 64, 65])
def test_a_big_weights_panels_share_one_row_block_among_threads(kernel_threads, rows, gemm, monkeypatch):
    """A call of up to 64 rows is one row block: a weight of WMT'19's size goes in panels of output columns,
    fixed by its shape, so that a second thread has work there too, and the bits stay those of one thread."""
    weight, bias, x, product = float32_product(gemm, 4096, 1024, rows)
    assert product.panels == [(0, 2048), (2048, 2048)]
    kernel_threads(1)
    alone = product.gemm_product(x)
    kernel_threads(2)
    _, shared_before, _ = module.parallel_counters()
    assert torch.equal(product.gemm_product(x), alone)
    _, shared_after, _ = module.parallel_counters()
    assert shared_after == shared_before + 1, "one row block of a 4096 x 1024 weight ran on the caller alone"
    reference = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert (alone.double() - reference).abs().max() < 1e-3
    # Smaller weights stay whole (a panel's call costs more than it gains there), and the variable keeps all whole.
    assert module.Product(weight[:1024], bias[:1024], "float32", kernel=gemm).panels == [(0, 1024)]
    from fairseq_stream.ops.product import PANELS_VARIABLE

    monkeypatch.setenv(PANELS_VARIABLE, "off")
    assert module.Product(weight, bias, "float32", kernel=gemm).panels == [(0, 4096)]
    # "all" splits any weight of two 64-column blocks or more, as many panels as the columns allow, up to 8.
    monkeypatch.setenv(PANELS_VARIABLE, "all")
    assert module.Product(weight[:1024], bias[:1024], "float32", kernel=gemm).panels == [
        (first, 128) for first in range(0, 1024, 128)]
    assert module.Product(weight[:192], bias[:192], "float32", kernel=gemm).panels == [(0, 64), (64, 64), (128, 64)]
    assert module.Product(weight[:100], bias[:100], "float32", kernel=gemm).panels == [(0, 100)]


# Decodes the toy's valid set with every float32 weight in panels (FAIRSEQ_STREAM_FLOAT32_PANELS=all) on two
# kernel threads and on one, and with every weight whole on two; prints each run's translations, scores and
# calls shared with a worker. A pool of 8 sentences at k=5 keeps a step's calls at 40 rows or fewer: one row block.
DECODE_THROUGH_PANELS = textwrap.dedent("""
    import json, os, sys
    from fairseq_stream.api import Translator
    from fairseq_stream.ops import threads
    toy, lines = sys.argv[1], open(sys.argv[2]).read().splitlines()[:48]
    runs = {}
    for panels, cpu_threads in (("all", 2), ("all", 1), ("off", 2)):
        os.environ["FAIRSEQ_STREAM_FLOAT32_PANELS"] = panels
        translator = Translator([toy + "/transformer/checkpoint_best.pt"], data=toy + "/data-bin",
                                search="var-batch", beam=5, pool=8, batch_size=8, cpu=True,
                                cpu_threads=cpu_threads)
        _, shared_before, _ = threads.parallel_counters()
        out = sorted([t.index, t.text, t.score] for t in translator.translate(lines))  # yielded as they finish
        _, shared_after, _ = threads.parallel_counters()
        runs["{}-{}".format(panels, cpu_threads)] = {"out": out, "shared": shared_after - shared_before}
    print(json.dumps(runs))
""")


@needs_kernels
@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_a_decode_through_panels_gives_one_threads_bits(toy, gemm):
    """A real decode whose float32 weights are all in panels (what a WMT'19 model's big ones take): two threads
    share its few-row calls and print one thread's translations and scores, bit for bit; whole weights give
    the same best scores to float32 rounding."""
    from fairseq_stream.ops import product as P

    skip_without(gemm)
    proc = subprocess.run([sys.executable, "-c", DECODE_THROUGH_PANELS, str(toy.root), str(toy.raw / "valid.src")],
                          cwd=REPO, capture_output=True, text=True,
                          env=dict(tool_env(), OMP_NUM_THREADS="2", **{P.GEMM_VARIABLE: gemm}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["all-2"]["out"] == runs["all-1"]["out"]
    assert runs["all-2"]["shared"] > runs["off-2"]["shared"], "the panels' row blocks ran on the caller alone"
    # Near-tied hypotheses may swap between the two sums' roundings; the best score cannot move.
    assert [i for i, _, _ in runs["all-2"]["out"]] == list(range(48))
    for (_, _, panelled), (_, _, whole) in zip(runs["all-2"]["out"], runs["off-2"]["out"]):
        assert panelled == pytest.approx(whole, abs=1e-4)


@needs_kernels
def test_the_loops_own_ops_check_their_arguments():
    for call in (lambda: module.parallel_sum_of_squares(-1, 1), lambda: module.parallel_sum_of_squares(5, 0),
                 lambda: module.set_kernel_threads(-1)):
        with pytest.raises(RuntimeError, match="parallel_sum_of_squares|set_kernel_threads"):
            call()


def test_the_layout_follows_the_option_then_the_cores_and_torch(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "_torch_threads", lambda: 2)
    assert threads.choose_layout(3) == threads.ThreadLayout(3, 1, "--cpu-threads 3")
    chosen = threads.choose_layout(None)
    assert (chosen.kernel_threads, chosen.torch_threads) == (2, 1)
    assert "OMP_NUM_THREADS" in chosen.reason
    monkeypatch.setattr(threads, "_torch_threads", lambda: 8)
    assert threads.choose_layout(None).kernel_threads == 4


@pytest.mark.parametrize("bad", [0, -1, 2.5, "2", True])
def test_a_bad_thread_count_is_refused(bad):
    with pytest.raises(FairseqStreamError, match="--cpu-threads must be a whole number of at least 1"):
        threads.check_cpu_threads(bad)


def test_fairseq_generate_says_the_layout_and_refuses_a_bad_one(toy):
    common = ["fairseq-generate", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
              "--gen-subset", "test", "--beam", "5", "--cpu", "--search", "var-batch"]
    ok = run_tool(common + ["--cpu-threads", "2"])
    assert "CPU threads: 2 threads for our kernels, torch's ops on 1 (--cpu-threads 2)" in ok.stderr
    bad = run_tool(common + ["--cpu-threads", "0"], check=False)
    assert bad.returncode != 0
    assert "--cpu-threads must be a whole number of at least 1, got 0" in bad.stderr
    assert "Traceback" not in bad.stderr


# A decode on our runner with two threads, run with openmp_regions.so preloaded: prints the OpenMP
# regions of more than one thread entered while decoding, our calls shared with a worker, and the
# translations.
DECODE_COUNTING_REGIONS = textwrap.dedent("""
    import ctypes, json, sys
    from fairseq_stream.api import Translator
    from fairseq_stream.ops import threads
    counter = ctypes.CDLL(None)
    toy, quantize, runner, lines = sys.argv[1], sys.argv[2], sys.argv[3], open(sys.argv[4]).read().splitlines()
    translator = Translator([toy + "/transformer/checkpoint_best.pt"], data=toy + "/data-bin", search="var-batch",
                            beam=5, batch_size=200, cpu=True, quantize=quantize, runner=runner, cpu_threads=2)
    list(translator.translate(lines[:8]))
    counter.openmp_regions_reset()
    _, shared_before, _ = threads.parallel_counters()
    out = [t.text for t in translator.translate(lines)]
    _, shared_after, _ = threads.parallel_counters()
    print(json.dumps({"regions": counter.openmp_regions(), "shared": shared_after - shared_before, "out": out}))
""")


@pytest.fixture(scope="module")
def region_counter(tmp_path_factory):
    """openmp_regions.so, compiled from tests/data/openmp_regions.c."""
    out = tmp_path_factory.mktemp("shim") / "openmp_regions.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(REPO / "tests" / "data" / "openmp_regions.c"), "-o",
                    str(out), "-ldl"], check=True)
    return out


@needs_kernels
@pytest.mark.parametrize("quantize, gemm, runner", [("none", "auto", "auto"), ("int8", "auto", "auto"),
                                                    ("none", "onednn", "auto"), ("none", "auto", "static")])
def test_a_two_thread_decode_enters_no_openmp_region(toy, region_counter, quantize, gemm, runner):
    """The collapse's cause counted: no region whose threads spin at a barrier, while our loop shares work.

    With OMP_NUM_THREADS=2 and torch's ops on two threads, this decode of the
    toy's valid set entered about 3,000 such regions (each a stall when
    another process holds a core); our kernels' calls of one batch of 200
    sentences are large enough to be shared with the second thread. oneDNN's
    float32 GEMM (an AMD CPU's for large weights) takes OpenMP's threads of
    the thread that calls it, ours included. The static-slot runner (issue
    53's step, run eagerly on the CPU) kept torch's threads until it took
    the same layout.
    """
    from fairseq_stream.ops import product as P

    if gemm == "onednn" and P.onednn_missing_reason():
        pytest.skip(P.onednn_missing_reason())
    gemm_env = {P.GEMM_VARIABLE: gemm}
    proc = subprocess.run([sys.executable, "-c", DECODE_COUNTING_REGIONS, str(toy.root), quantize, runner,
                           str(toy.raw / "valid.src")], cwd=REPO, capture_output=True, text=True,
                          env=dict(tool_env(), LD_PRELOAD=str(region_counter), OMP_NUM_THREADS="2", **gemm_env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["regions"] == 0
    assert result["shared"] > 0
    one = run_tool([sys.executable, "-c", DECODE_COUNTING_REGIONS.replace("cpu_threads=2", "cpu_threads=1"),
                    str(toy.root), quantize, runner, str(toy.raw / "valid.src")],
                   env=dict(LD_PRELOAD=str(region_counter), OMP_NUM_THREADS="1", **gemm_env))
    assert json.loads(one.stdout.strip().splitlines()[-1])["out"] == result["out"]
