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
import types
from pathlib import Path

import pytest

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
                     "--limit", "2", "--models-count", "1", "--beams", "5", "--warm-up", "on",
                     "--methods", "var-stream-rows", "greedy", "--kernel-runs", "var-stream-rows-k5",
                     "--kernel-window", "1", "2"],
                    check=False)
    results, summary = read(out)
    assert proc.returncode == 0, summary
    steps = results["steps"]
    assert list(steps) == ["setup", "environment", "standin", "prepare", "behaviour", "decode", "report", "targets",
                           "kernels"]
    assert all(s["status"] in ("passed", "skipped") for s in steps.values()), summary
    # One beam here to keep CI's time (the script's default is k=5 and k=50, the same code path).
    # Greedy first: a target's run (gpu_bench.PRIORITY) decodes before the others.
    assert list(steps["decode"]["runs"]) == ["greedy", "var-stream-rows-k5"]
    assert all(r["cold_decode_s"] > 0 and r["models_kept"] for r in steps["decode"]["runs"].values())
    rows = steps["report"]["rows"]
    assert [(r["method"], r["beam"]) for r in rows] == [("greedy", None), ("var-stream-rows", 5)]
    for r in rows:
        assert r["sentences"] == 2 and r["counters"]["timesteps"] > 0 and r["host_ms_per_call"] > 0
        assert r["device"] == "cpu" and r["gpu_busy"] is None and r["peak_mib"] is None
    # report.py's tables and plots: one bar chart and one BLEU scatter per beam.
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == ["bleu_vs_decode_cpu_beam5.png",
                                                                    "decode_cpu_beam5.png"]
    assert "| de-en | newstest2017 | greedy |" in (out / "plots" / "report.md").read_text()
    # The kernels step: the profiler over calls 1-2 of a run's first decode (ATen's CPU time here).
    kernels = steps["kernels"]["profiled"]["var-stream-rows-k5"]["kernels"]
    assert kernels["clock"] == "cpu" and kernels["calls"] == 2 and kernels["first_call"] == 1
    assert kernels["ms_per_call"] > 0 and kernels["launches_per_call"] > 0
    # (The CPU's products are our compiled kernels, outside ATen: no products here.)
    assert abs(sum(kernels["by_kind"].values()) - kernels["ms_per_call"]) < 1e-3
    assert kernels["top"][0]["ms_per_call"] > 0
    assert "| var-stream-rows-k5 | cpu |" in summary
    # A lent machine returns at most 8 files of OUTDIR.
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8
    # A second command on the same machine decodes more methods and adds them to the first's.
    again = tmp_path / "again"
    proc = run_tool(["bash", REPO / "scripts" / "gpu_bench.sh", again, "--device", "cpu", "--work-dir", tmp_path / "w",
                     "--standin", tmp_path / "w" / "standin", "--resume", out / "results.json",
                     "--steps", "decode", "report", "--source", WMT / "newstest2017.de", "--reference",
                     WMT / "newstest2017.en", "--limit", "2", "--beams", "5", "--methods", "jacobi"], check=False)
    results, summary = read(again)
    assert proc.returncode == 0, summary
    runs = results["steps"]["decode"]["runs"]
    assert list(runs) == ["greedy", "var-stream-rows-k5", "jacobi"]
    assert runs["greedy"]["resumed"] and not runs["jacobi"].get("resumed")
    assert [r["method"] for r in results["steps"]["report"]["rows"]] == ["greedy", "var-stream-rows", "jacobi"]


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


def load_benchmark(name):
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / (name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe(tmp_path, runs, keep_models=False, warm_up=False):
    """Decode ``runs`` ({name: argv}) through gpu_probe.py on the CPU; {name: (result, generate-test.txt)}."""
    entries = [{"name": n, "argv": argv, "results": str(tmp_path / n), "result": str(tmp_path / (n + ".json"))}
               for n, argv in runs.items()]
    plan = {"device": "cpu", "keep_models": keep_models, "warm_up": warm_up, "runs": entries}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    run_tool(["python", REPO / "benchmarks" / "gpu_probe.py", tmp_path / "plan.json"])
    return {n: (json.loads((tmp_path / (n + ".json")).read_text()), str(tmp_path / n / "generate-test.txt"))
            for n in runs}


def test_behaviour_check_finds_the_trained_toy_trained_like(toy, tmp_path):
    """The check gpu_bench runs on its stand-in, on a trained model: EOS before the bound, pruning cuts."""
    behaviour = load_benchmark("standin_behaviour")
    common = [toy.data_bin, "--path", toy.transformer, "--user-dir", REPO / "fairseq_stream", "--gen-subset", "test",
              "--batch-size", "16", "--num-workers", "0", "--cpu", "--cpu-workers", "1", "--beam", "5"]
    out = probe(tmp_path, {m: [str(a) for a in common + ["--preset", m]] for m in ("fixed", "var-batch")})
    (fixed, fixed_out), (var, var_out) = out["fixed"], out["var-batch"]
    found = behaviour.behaviour(fixed_out, var_out, fixed["rows"], var["rows"])
    assert found["sentences"] == fixed["sentences"] == 37 and found["var_batch_sentences"] == 37
    assert found["eos_share"] == 1.0 and 0.5 <= found["length_ratio"] <= 2.0, found
    assert var["rows"] > 0 and found["expansions_ratio"] == round(var["rows"] / fixed["rows"], 3) < 0.9, found
    assert found["trained_like"] and "trained-like" in behaviour.describe(found)
    # A bound the toy's hypotheses reach makes every one of them count as cut.
    assert behaviour.behaviour(fixed_out, var_out, fixed["rows"], var["rows"], max_len=2)["eos_share"] == 0.0


def test_the_probe_loads_each_checkpoint_list_once_and_prints_the_same(toy, tmp_path):
    """gpu_bench's plans keep the members between runs (loading four WMT-sized members took longer than most
    decodes) and, on a GPU, measure each run's second decode: a later run with the same list and precision
    reuses the members and prints a fresh load's lines."""
    common = [toy.data_bin, "--user-dir", REPO / "fairseq_stream", "--gen-subset", "test", "--batch-size", "16",
              "--num-workers", "0", "--cpu", "--cpu-workers", "1", "--beam", "5"]
    pair = "{}:{}".format(toy.transformer, toy.transformer2)
    runs = {"fixed": ["--path", pair, "--preset", "fixed"], "var-batch": ["--path", pair, "--preset", "var-batch"],
            "one": ["--path", toy.transformer, "--preset", "fixed"],
            "fixed-again": ["--path", pair, "--preset", "fixed"]}
    out = probe(tmp_path, {n: [str(a) for a in common + argv] for n, argv in runs.items()}, keep_models=True,
                warm_up=True)
    # Warmed up: each run's measured decode is its second, after one that loaded (or reused) the members.
    assert {n: r["models_kept"] for n, (r, _) in out.items()} == dict.fromkeys(runs, True)
    assert all(r["cold_decode_s"] > 0 and r["decode_s"] > 0 for r, _ in out.values())
    (tmp_path / "fresh").mkdir()
    fresh = probe(tmp_path / "fresh", {"var-batch": [str(a) for a in common + runs["var-batch"]],
                                        "one": [str(a) for a in common + runs["one"]],
                                        "fixed": [str(a) for a in common + runs["fixed"]]}, keep_models=True)
    assert {n: r["models_kept"] for n, (r, _) in fresh.items()} == {"var-batch": False, "one": False, "fixed": True}
    assert "cold_decode_s" not in fresh["var-batch"][0]
    lines = lambda path: sorted(l for l in Path(path).read_text().splitlines() if l[:2] in ("H-", "P-"))  # noqa: E731
    assert lines(out["var-batch"][1]) == lines(fresh["var-batch"][1])
    assert lines(out["fixed-again"][1]) == lines(out["fixed"][1])
    assert all(r["sentences"] == 37 for r, _ in out.values())


def test_the_timed_decodes_length_options_follow_the_behaviour_check():
    """Trained-like: fairseq's bound; hypotheses too long (untrained): ours; far too short (the H200's 60 s
    stand-in said "The ."): at least the sample's median source length, within a bound fairseq accepts."""
    bench = load_benchmark("gpu_bench")
    args = bench.parser().parse_args(["out"])
    options = lambda found, **kw: bench.length_options(  # noqa: E731
        types.SimpleNamespace(results={"behaviour": found}), args if not kw else bench.parser().parse_args(
            ["out", "--max-len", kw["max_len"]]))
    trained = {"trained_like": True, "length_ratio": 0.96, "median_source_tokens": 21}
    long = {"trained_like": False, "length_ratio": 3.5, "median_source_tokens": 21}
    short = {"trained_like": False, "length_ratio": 0.08, "median_source_tokens": 21}
    assert options(trained) == [] and options(long) == bench.BOUND
    assert options(short) == ["--max-len-a", "1.2", "--max-len-b", "21", "--min-len", "21"]
    assert options(short, max_len="bound") == bench.BOUND and options(trained, max_len="bound") == bench.BOUND
    assert options({"error": "no hypotheses"}) == bench.BOUND


def test_the_short_stand_ins_options_decode_every_sentence_at_least_that_long(toy, tmp_path):
    """fairseq's beam and ours under those options: no min_len > max_len assertion on a short source, every
    hypothesis at least --min-len tokens before its EOS."""
    bench = load_benchmark("gpu_bench")
    least = 30  # above most of the toy's own lengths (10-25 tokens): the bound decides
    extra = bench.length_options(types.SimpleNamespace(results={"behaviour": {
        "trained_like": False, "length_ratio": 0.08, "median_source_tokens": least}}), bench.parser().parse_args(
        ["out"]))
    common = [toy.data_bin, "--path", toy.transformer, "--user-dir", REPO / "fairseq_stream", "--gen-subset",
              "test", "--batch-size", "16", "--num-workers", "0", "--cpu", "--beam", "5"]
    methods = {"beam": [], "var-stream": ["--cpu-workers", "1"]}  # one process: the probe counts its own calls
    out = probe(tmp_path, {m: [str(a) for a in common + ["--preset", m] + extra + more] for m, more in methods.items()})
    for result, path in out.values():
        assert result["error"] is None and result["sentences"] == 37
        lengths = [len(line.split("\t")[2].split()) for line in Path(path).read_text().splitlines()
                   if line.startswith("H-")]
        assert len(lengths) == 37 and min(lengths) >= least


@pytest.mark.slow
def test_gpu_bench_trains_a_two_member_standin_and_checks_its_behaviour(tmp_path):
    """The GPU run's path on the CPU: model1 trained a few seconds, model2 derived, the check recorded, the
    static step's methods decoded in the targets' order and the targets computed."""
    import torch

    out = tmp_path / "bench"
    proc = run_tool(["bash", REPO / "scripts" / "gpu_bench.sh", out, "--device", "cpu", "--work-dir", tmp_path / "w",
                     "--train-text", WMT / "newstest2016.de", WMT / "newstest2016.en", "--train-seconds", "3",
                     "--source", WMT / "newstest2017.de", "--reference", WMT / "newstest2017.en",
                     "--limit", "4", "--models-count", "2", "--beams", "5", "--methods", "greedy", "jacobi",
                     "fixed-graphs", "fixed-graphs-1member"], check=False)
    results, summary = read(out)
    assert proc.returncode == 0, summary
    record = json.loads((tmp_path / "w" / "standin" / "standin.json").read_text())["settings"]
    assert record["train_seconds"] == 3 and record["member_noise"] == 0.02 and record["models"] == 2
    m1, m2 = (torch.load(tmp_path / "w" / "standin" / "model{}.pt".format(i), weights_only=False) for i in (1, 2))
    assert m1["optimizer_history"][-1]["num_updates"] > 0  # model1 trained (a few updates on the CPU)
    key = "decoder.layers.0.fc1.weight"
    assert 0 < (m1["model"][key] - m2["model"][key]).abs().max() < m1["model"][key].std()  # model2: model1 + noise
    found = results["behaviour"]
    assert found["sentences"] == 4 and 0 <= found["eos_share"] <= 1 and found["expansions_ratio"] is not None
    assert found["multi30k_expansions_ratio"] == 0.562 and "| behaviour | passed |" in summary
    # A few CPU updates do not make a trained model: the timed decodes keep the length bound, and say so.
    assert results["steps"]["decode"]["length_options"] == ([] if found["trained_like"] else
                                                            ["--max-len-a", "1.2", "--max-len-b", "10"])
    runs = results["steps"]["decode"]["runs"]
    assert list(runs) == ["fixed-graphs-k5", "fixed-graphs-1member-k5", "jacobi", "greedy"]  # PRIORITY's order
    assert all(r["error"] is None and r["sentences"] == 4 and r["host_ms_per_call"] > 0 for r in runs.values())
    targets = {t["target"]: t for t in results["steps"]["targets"]["targets"]}
    assert targets["jacobi / greedy, sentences/s"]["value"] > 0
    assert "tokens equal greedy's" in targets["jacobi / greedy, sentences/s"]["detail"]
    assert targets["4 stacked members / 1 member, time"]["value"] > 0
    assert targets["host ms/call, fixed-graphs-k5"]["value"] == runs["fixed-graphs-k5"]["host_ms_per_call"]
    beam = targets["var-stream-graphs-k5 / fairseq beam k=5, sentences/s"]
    assert beam["met"] is None and beam["detail"] == "not decoded: var-stream-graphs-k5, beam-k5"
    assert "## Targets (issues 53 and 52)" in summary


def test_gpu_bench_static_methods_command_lines(tmp_path):
    """The static step's methods: graphs on where CUDA is (auto, eager, on the CPU), one member alone,
    the members one after another; the runs in the targets' order."""
    bench = load_benchmark("gpu_bench")
    standin = tmp_path / "standin"
    standin.mkdir()
    for i in (1, 2, 3, 4):
        (standin / "model{}.pt".format(i)).write_bytes(b"")
    for cuda, graphs in ((False, "auto"), (True, "on")):
        session = types.SimpleNamespace(results={"data_bin": str(tmp_path)}, cuda=cuda, work=str(tmp_path))
        args = bench.parser().parse_args([str(tmp_path / "out"), "--standin", str(standin), "--beams", "5", "50",
                                          "--stack-members", "on", "--no-fp16"])
        runs = {r["name"]: r["argv"] for r in bench.ordered_runs(session, args)}
        assert list(runs)[:4] == ["beam-k5", "var-stream-graphs-k5", "fixed-graphs-k5", "fixed-graphs-1member-k5"]
        assert len(runs) == 2 * len(bench.METHODS) - len(bench.BEAMLESS)
        option = lambda name, flag: [runs[name][i + 1] for i, a in enumerate(runs[name]) if a == flag]  # noqa: E731
        assert option("fixed-graphs-k5", "--cuda-graphs") == [graphs]
        assert option("fixed-graphs-k5", "--host-lag") == ["2"]
        assert option("fixed-static-k5", "--cuda-graphs") == ["off"]
        assert option("fixed-static-k5", "--runner") == ["static"]
        assert option("var-stream-graphs-k50", "--host-lag") == [] and option("greedy-graphs", "--beam") == []
        assert option("fixed-graphs-1member-k5", "--path") == [str(standin / "model1.pt")]
        assert option("fixed-graphs-k5", "--path")[0].count(":") == 3
        assert option("fixed-graphs-unstacked-k5", "--stack-members") == ["off"]
        assert option("fixed-graphs-k5", "--stack-members") == ["on"] and option("beam-k5", "--stack-members") == []


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_bench.sh"])
def test_a_step_name_that_matches_none_fails_the_run(script, tmp_path):
    """--steps with a typo skipped every step and reported '0 failed', status 0."""
    proc = run_tool(["bash", REPO / "scripts" / script, tmp_path / "out", "--device", "cpu", "--work-dir",
                     tmp_path / "w", "--steps", "nosuch"], check=False)
    assert proc.returncode == 2
    assert "error: --steps nosuch: no such step (the steps: setup environment " in proc.stderr


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_bench.sh"])
def test_a_missing_resume_file_is_one_line(script, tmp_path):
    proc = run_tool(["bash", REPO / "scripts" / script, tmp_path / "out", "--device", "cpu", "--work-dir",
                     tmp_path / "w", "--resume", tmp_path / "none.json"], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("error: --resume {}: No such file or directory".format(
        tmp_path / "none.json"))


@pytest.mark.parametrize("name, kind", [
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT", "products"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x6_tn_align8>(Params)", "products"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4> >(Flash_fwd_params)",
     "softmax/attention"),
    ("void (anonymous namespace)::softmax_warp_forward<c10::Half, c10::Half, float, 8, true, false>(...)",
     "softmax/attention"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)", "top-k"),
    ("void at::native::index_elementwise_kernel<128, 4, ...>(long, ...)", "moves"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float>(...)", "reductions"),
    ("void fairseq_stream::(anonymous namespace)::stay_select_kernel<float>(StaySelectArgs<float>)", "ours"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>, ...>(...)",
     "elementwise and other"),
])
def test_kernel_kinds(name, kind):
    assert load_benchmark("gpu_kernels").kind_of(name) == kind
