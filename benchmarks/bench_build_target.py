"""Builds of the kernels against each other: the same work on each, interleaved; CPU time and the outputs' bits.

The kernels' generic code compiles for x86-64-v3 unless FAIRSEQ_STREAM_MARCH
names another target (setup.py; before, for ``-march=native``). Each build is a
tree holding ``fairseq_stream/`` with its compiled ``_ops_cpu`` (``--builds
NAME=TREE``). Every round runs each build in a fresh process, the CPU at its
own level and capped at AVX2 (``--caps``: ATEN_CPU_CAPABILITY=avx2, which our
kernels follow, MKL_ENABLE_INSTRUCTIONS=AVX2, DNNL_MAX_CPU_ISA=AVX2), in an
order that turns each round, on one thread:

* kernels, on random inputs of the Multi30k model's sizes (256 wide, 8k words)
  and the WMT'19 models' (1024 wide, 32k words): the fused output layer
  (``topk_log_softmax``, backend cpu), the float product at one and five rows
  (``product``: the skinny product's tiles), the int16 and int8
  products (``quantized_linear``, the best kernel the level allows);
* decoding the toy's valid set (200 sentences) through the Python API: the
  transformer greedy, fixed k=5 and var-stream k=5 (lean runner, fused
  output layer), at ``--quantize int8``, and the LSTM at ``--quantize int16``.

Per item: CPU milliseconds per call (``time.process_time`` around calls
repeated for 0.3 s of CPU, 0.6 s for a decoding pass, after an untimed call:
on a machine shared with other work, what the process ran, not what it
waited for), the median over the rounds (and the best: other work only adds
time);
and a digest of the outputs (every value's bits, every translation and score),
which must be equal across builds at the same cap: the target changes speed,
not results.

    python benchmarks/bench_build_target.py --toy "$(python scripts/toy_cache.py)" \\
        --builds native=/tmp/native-tree baseline=. [--rounds 5] [--caps none avx2] [--json FILE]
"""

import preamble  # first: the import paths, then the threads before torch starts its pools

preamble.set_threads(1)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

CAPS = {"none": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                             "DNNL_MAX_CPU_ISA": "AVX2"}}
# (name, search, options, checkpoint) of the decoding items; options go to the Translator as fairseq's do.
DECODES = [("decode greedy", "greedy", {}, "transformer"), ("decode fixed k=5", "fixed", {}, "transformer"),
           ("decode var-stream k=5", "var-stream", {}, "transformer"),
           ("decode var-stream k=5 int8", "var-stream", {"quantize": "int8"}, "transformer"),
           ("decode LSTM fixed k=5 int16", "fixed", {"quantize": "int16"}, "lstm")]


def digest(*tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def timed(work, min_cpu: float):
    """(CPU ms a call, wall ms a call, the last call's result): calls after an untimed one, for min_cpu seconds."""
    result = work()
    calls, cpu, wall = 0, time.process_time(), time.perf_counter()
    while calls == 0 or time.process_time() - cpu < min_cpu:
        result = work()
        calls += 1
    return 1000 * (time.process_time() - cpu) / calls, 1000 * (time.perf_counter() - wall) / calls, result


def kernel_items(torch):
    """(name, work, CPU seconds to time it, outputs -> tensors) of the kernel items."""
    from fairseq_stream.ops import output_layer as ol, product, quantized_linear

    g = torch.Generator().manual_seed(0)
    items = []
    for rows, vocab, n in ((5, 32000, 5), (64, 8000, 10)):
        logits = torch.randn(rows, vocab, generator=g) * 3
        items.append(("output layer {} x {}, n={}".format(rows, vocab, n),
                      lambda z=logits, n=n: ol.topk_log_softmax(z, n, pad=1, eos=2, backend="cpu"), 0.3,
                      lambda r: (r.values, r.indices, r.eos)))
    for rows, out_f, in_f in ((1, 1024, 1024), (5, 4096, 1024), (5, 1024, 256)):
        w = torch.randn(out_f, in_f, generator=g) * in_f ** -0.5
        b = torch.randn(out_f, generator=g) * 0.1
        x = torch.randn(rows, in_f, generator=g)
        shape = "{} x {}x{}".format(rows, out_f, in_f)
        products = [("float32", product.linear(w, b))]
        products += [(kind, product.linear(w, b, kind)) for kind in ("int8", "int16")]
        for kind, made in products:
            items.append(("{} product {}".format(kind, shape), lambda f=made, x=x: f(x), 0.3, lambda r: (r,)))
    return items


def decode_items(toy):
    """(name, work, CPU seconds to time it, outputs -> strings) of the decoding items: a pass over the valid set."""
    from fairseq_stream.api import Translator

    with open(os.path.join(toy, "raw", "valid.src"), encoding="utf-8") as f:
        sentences = f.read().splitlines()
    items = []
    for name, search, options, model in DECODES:
        translator = Translator([os.path.join(toy, model, "checkpoint_best.pt")], data=os.path.join(toy, "data-bin"),
                                search=search, beam=5, pool=64, cpu=True, **options)
        items.append((name, lambda t=translator: list(t.translate(sentences)), 0.6,
                      lambda r: ["{} {} {!r}".format(t.index, t.text, t.score) for t in r]))
    return items


def worker(toy: str) -> dict:
    """Every item in this process, on the build this tree holds: what one round records for it."""
    import torch

    from fairseq_stream import cpu_info
    from fairseq_stream.ops import output_layer as ol, product, quantized_linear

    torch.set_num_threads(1)
    library = ol._library_path("fairseq_stream._ops_cpu")
    assert ol.compiled_module("cpu") is not None, ol.missing_reason("cpu")
    record = {"library": library, "needs": sorted(cpu_info.build_needs(library) or ()),
              "simd_level": cpu_info.simd_level(), "skinny_kernel": product.skinny_kernel(),
              "int8_kernel": quantized_linear.kernel("int8"), "int16_kernel": quantized_linear.kernel("int16"),
              "items": {}}
    for name, work, min_cpu, outputs in kernel_items(torch) + decode_items(toy):
        cpu_ms, wall_ms, result = timed(work, min_cpu)
        out = outputs(result)
        text = "\n".join(out) if out and isinstance(out[0], str) else None
        record["items"][name] = {"cpu_ms": cpu_ms, "wall_ms": wall_ms,
                                 "digest": hashlib.sha1(text.encode()).hexdigest()[:16] if text else digest(*out)}
    return record


def run_worker(tree: str, toy: str, caps: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in CAPS["avx2"]}
    env.update(CAPS[caps])
    script = os.path.join(os.path.abspath(tree), "benchmarks", os.path.basename(__file__))
    proc = subprocess.run([sys.executable, script, "--worker", "--toy", toy], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit("bench_build_target: the worker in {} failed:\n{}".format(tree, proc.stderr[-3000:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(builds, toy: str, caps_list, rounds: int) -> dict:
    """{caps: {build: [record of each round]}}, the builds' order turning each round."""
    runs = {caps: {name: [] for name, _ in builds} for caps in caps_list}
    for r in range(rounds):
        for caps in caps_list:
            order = builds[r % len(builds):] + builds[:r % len(builds)]
            for name, tree in order:
                runs[caps][name].append(run_worker(tree, toy, caps))
                print("round {} caps={} {}: done".format(r + 1, caps, name), file=sys.stderr, flush=True)
    return runs


def summarize(runs, builds) -> list:
    """One row per cap and item: each build's median (and best) CPU ms, the last build's over the first's, and
    whether every build gave the same outputs."""
    rows = []
    names = [name for name, _ in builds]
    for caps, per_build in runs.items():
        for item in per_build[names[0]][0]["items"]:
            times = {n: [rec["items"][item]["cpu_ms"] for rec in per_build[n]] for n in names}
            medians = {n: statistics.median(t) for n, t in times.items()}
            best = {n: min(t) for n, t in times.items()}  # other work on the machine only ever adds time
            digests = {rec["items"][item]["digest"] for n in names for rec in per_build[n]}
            rows.append({"caps": caps, "item": item, "cpu_ms": medians, "cpu_ms_best": best,
                         "ratio": medians[names[-1]] / medians[names[0]],
                         "ratio_best": best[names[-1]] / best[names[0]], "same_outputs": len(digests) == 1,
                         "kernels": {n: per_build[n][0]["skinny_kernel"] + "/" + per_build[n][0]["int8_kernel"]
                                     for n in names}})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toy", required=True, help="the toy models' folder (python scripts/toy_cache.py)")
    parser.add_argument("--builds", nargs="+", default=[], metavar="NAME=TREE",
                        help="trees with a built fairseq_stream, the reference first")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--caps", nargs="+", default=["none", "avx2"], choices=sorted(CAPS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.toy)))
        return
    builds = [tuple(b.split("=", 1)) for b in args.builds]
    runs = measure(builds, args.toy, args.caps, args.rounds)
    rows = summarize(runs, builds)
    names = [name for name, _ in builds]
    print("{:<5} {:<34} ".format("caps", "item") + " ".join("{:>12}".format(n + " ms") for n in names)
          + " {:>8} {:>10} {:>6}".format("ratio", "best ratio", "same"))
    for row in rows:
        print("{:<5} {:<34} ".format(row["caps"], row["item"])
              + " ".join("{:>12.4f}".format(row["cpu_ms"][n]) for n in names)
              + " {:>8.3f} {:>10.3f} {:>6}".format(row["ratio"], row["ratio_best"], "yes" if row["same_outputs"] else "NO"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"builds": dict(builds), "rounds": args.rounds, "rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
