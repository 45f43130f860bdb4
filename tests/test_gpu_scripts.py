"""scripts/gpu_check.sh and scripts/gpu_bench.sh in their CPU mode: every step runs or says why not.

The scripts exist for lent GPU machines (docs/GPU.md). Here they run with
``--device cpu`` on the toy and on a tiny WMT'19 stand-in built from the
committed newstest sample, so that they cannot rot while no GPU is lent. To
stay within CI's time, each decodes a few methods (both scripts' full lists
are the same command lines with other options): fairseq's beam against our
fixed search (identical, scores too), Jacobi against greedy (identical), the
top-up and stream generators, two beams.
"""

import json
import tarfile

from conftest import REPO, run_tool

WMT = REPO / "tests" / "data" / "wmt" / "de-en"
CHECK_METHODS = ["beam", "fixed", "topup", "greedy", "jacobi"]


def read(outdir):
    results = json.loads((outdir / "results.json").read_text())
    return results, (outdir / "summary.md").read_text()


def test_gpu_check_cpu_mode(toy, tmp_path):
    out = tmp_path / "check"
    proc = run_tool(["bash", REPO / "scripts" / "gpu_check.sh", out, "--device", "cpu", "--toy", toy.root,
                     "--work-dir", tmp_path / "work", "--methods"] + CHECK_METHODS, check=False)
    results, summary = read(out)
    assert proc.returncode == 0, summary
    steps = results["steps"]
    assert list(steps) == ["setup", "environment", "build", "cuda-tests", "decode-toy-cpu", "decode-m30k",
                           "compare"]
    assert steps["build"]["status"] == steps["cuda-tests"]["status"] == "skipped"
    assert "no CUDA" in steps["build"]["detail"]
    runs = steps["decode-toy-cpu"]["runs"]
    assert list(runs) == CHECK_METHODS
    for name, run in runs.items():
        assert run["error"] is None, name
        assert run["sentences"] == 37 and run["calls"] > 0 and run["rows_per_call"] >= 1, name
        assert run["host_ms_per_call"] > 0 and run["decode_s"] > 0, name
        assert run["gpu_busy"] is None and run["peak_mib"] is None, name  # no GPU figures on the CPU
    assert runs["greedy"]["rows_per_call"] < runs["beam"]["rows_per_call"]
    checks = {(c["method"], c["reference"]): c for c in steps["compare"]["checks"]}
    # Where the plugin promises identity, every printed hypothesis is identical, fixed's scores too.
    for key, kind in [(("fixed", "beam (same run)"), "exact+scores"), (("jacobi", "greedy (same run)"), "exact")]:
        assert checks[key]["kind"] == kind and checks[key]["status"] == "passed", checks[key]
        assert checks[key]["identical"] == checks[key]["sentences"] == 37
    assert checks[("topup", "fixed (same run)")]["status"] in ("passed", "differs")  # near ties may flip
    assert "n/a (cpu)" in summary and "| compare | passed |" in summary
    with tarfile.open(out / "details.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("beam/generate-test.txt") for n in names) and "logs/environment.log" in names


def test_gpu_bench_cpu_mode(tmp_path):
    out = tmp_path / "bench"
    proc = run_tool(["bash", REPO / "scripts" / "gpu_bench.sh", out, "--device", "cpu", "--work-dir", tmp_path / "w",
                     "--train-text", WMT / "newstest2016.de", WMT / "newstest2016.en",
                     "--source", WMT / "newstest2017.de", "--reference", WMT / "newstest2017.en",
                     "--limit", "2", "--models-count", "1", "--beams", "5",
                     "--methods", "var-stream-rows", "greedy"], check=False)
    results, summary = read(out)
    assert proc.returncode == 0, summary
    steps = results["steps"]
    assert list(steps) == ["setup", "environment", "standin", "prepare", "decode", "report"]
    assert all(s["status"] in ("passed", "skipped") for s in steps.values()), summary
    # One beam here to keep CI's time (the script's default is k=5 and k=50, the same code path).
    assert list(steps["decode"]["runs"]) == ["var-stream-rows-k5", "greedy"]
    rows = steps["report"]["rows"]
    assert [(r["method"], r["beam"]) for r in rows] == [("var-stream-rows", 5), ("greedy", None)]
    for r in rows:
        assert r["sentences"] == 2 and r["counters"]["timesteps"] > 0 and r["host_ms_per_call"] > 0
        assert r["device"] == "cpu" and r["gpu_busy"] is None and r["peak_mib"] is None
    # report.py's tables and plots: one bar chart and one BLEU scatter per beam.
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == ["bleu_vs_decode_cpu_beam5.png",
                                                                    "decode_cpu_beam5.png"]
    assert "| de-en | newstest2017 | greedy |" in (out / "plots" / "report.md").read_text()
    # A lent machine returns at most 8 files of OUTDIR.
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8


def test_gpu_bench_passes_stack_members_to_our_methods(tmp_path):
    """``--stack-members off`` reaches every method of ours (not fairseq's beam); auto adds nothing."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "benchmarks" / "gpu_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    standin = tmp_path / "standin"
    standin.mkdir()
    (standin / "model1.pt").write_bytes(b"")
    session = types.SimpleNamespace(results={"data_bin": str(tmp_path)}, cuda=False, work=str(tmp_path))
    for value, expected in (("off", ["--stack-members", "off"]), ("auto", [])):
        args = bench.parser().parse_args([str(tmp_path / "out"), "--standin", str(standin), "--methods", "beam",
                                          "fixed", "--beams", "5", "--stack-members", value])
        runs = {r["method"]: r["argv"] for r in bench.runs_for(session, args, 5, True)}
        assert "--stack-members" not in runs["beam"]
        assert [a for a in runs["fixed"] if a in ("--stack-members", "off")] == expected
