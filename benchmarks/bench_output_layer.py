"""Output-layer micro-benchmark: the fused op against today's log_softmax + topk, and topk alone.

Per (rows, V, n), the time of one output layer over (rows, V) float32 logits:

* ``fused``: ``fairseq_stream.ops.topk_log_softmax(logits, n, pad=1, eos=2,
  backend=<cpu|cuda>)``: log-softmax, the pad rule and top-n in the compiled kernel;
* ``ls+topk``: ``torch.log_softmax(logits, -1, dtype=float32).topk(n)``, what a
  decoder step does today (the search's rules cost a few more passes on top);
* ``topk``: ``logits.topk(n)`` on the raw logits, the floor: no normalization at all.

``speedup`` is ls+topk / fused; ``vs floor`` is fused / topk. The issue's targets
(CPU, one thread): speedup >= 2 for n <= 10 and >= 1.5 for n = 100; the target column
says ``ok`` or ``MISS`` for those rows. With ``--models M`` (M > 1) every method gets M
models' logits: ``fused`` is the ensemble op, ``ls+topk`` is fairseq's ensemble
(``logsumexp(stack(log_softmax_m)) - log M``, then topk), ``topk`` the first model's.

Logits are Gaussian (std 3, a fixed seed), words in random order: no help from a
frequency-sorted vocabulary. Each time is the best of ``--repeats`` rounds of enough
calls to last ``--min-time`` seconds (at least one call), taken after a warm-up call.

    python benchmarks/bench_output_layer.py [--device cpu|cuda] [--threads 1] \\
        [--rows 5 64 320 3200] [--vocab 8000 32000 42000] [--n 1 10 100 200] \\
        [--models 1] [--repeats 3] [--min-time 0.2] [--json FILE]

On ``--device cuda`` the times are CUDA-event times around synchronized loops.
"""

import preamble  # noqa: F401  (first: the import paths)

import argparse
import json
import math
import platform
import time

import torch

from fairseq_stream.ops import output_layer as ol

TARGETS = {1: 2.0, 10: 2.0, 100: 1.5}  # n -> least speedup over log_softmax + topk (CPU, 1 thread)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def timer(device):
    """A function that times ``fn`` (seconds per call: the best of the rounds)."""
    cuda = device == "cuda"

    def measure(fn, repeats, min_time):
        fn()  # warm-up (allocations, first-touch, kernel loading)
        if cuda:
            torch.cuda.synchronize()
        # How many calls make a round of at least min_time.
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        one = max(time.perf_counter() - start, 1e-7)
        calls = max(1, int(math.ceil(min_time / one)))
        best = float("inf")
        for _ in range(repeats):
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(calls):
                    fn()
                end.record()
                torch.cuda.synchronize()
                elapsed = begin.elapsed_time(end) / 1000.0
            else:
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                elapsed = time.perf_counter() - start
            best = min(best, elapsed / calls)
        return best

    return measure


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU); the issue's numbers use 1")
    parser.add_argument("--rows", type=int, nargs="+", default=[5, 64, 320, 3200])
    parser.add_argument("--vocab", type=int, nargs="+", default=[8000, 32000, 42000])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 10, 100, 200])
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per round (at least one call)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    backend = args.device
    if backend not in ol.available_backends():
        parser.error("the {} kernel is not built: python setup.py build_ext --inplace".format(backend))
    measure = timer(args.device)
    ext = ol.compiled_module(backend)
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else "{}, {} thread(s), SIMD {}".format(cpu_name(), torch.get_num_threads(), getattr(ext, "simd", "?")))
    print("fairseq-stream output layer, {}: {} (torch {})".format(args.device, where, torch.__version__))
    print("float32 logits, Gaussian std 3; {} model(s); pad rule on; best of {} rounds of >= {} s".format(
        args.models, args.repeats, args.min_time))

    header = "{:>5} {:>6} {:>4} | {:>10} {:>10} {:>8} | {:>10} {:>8} | {:>6}".format(
        "rows", "V", "n", "fused ms", "ls+topk ms", "speedup", "topk ms", "vs floor", "target")
    print(header)
    print("-" * len(header))
    results = []
    gen = torch.Generator().manual_seed(0)
    log_m = math.log(args.models)
    for rows in args.rows:
        for V in args.vocab:
            members = [(torch.randn(rows, V, generator=gen) * 3).to(args.device) for _ in range(args.models)]
            logits = members[0] if args.models == 1 else members
            for n in args.n:
                if n > V:
                    continue
                fused = measure(lambda: ol.topk_log_softmax(logits, n, pad=1, eos=2, backend=backend),
                                args.repeats, args.min_time)
                if args.models == 1:
                    def today():
                        return torch.log_softmax(members[0], -1, dtype=torch.float32).topk(n)
                else:
                    def today():
                        lp = [torch.log_softmax(x, -1, dtype=torch.float32) for x in members]
                        return (torch.logsumexp(torch.stack(lp, dim=0), dim=0) - log_m).topk(n)
                baseline = measure(today, args.repeats, args.min_time)
                floor = measure(lambda: members[0].topk(n), args.repeats, args.min_time)
                speedup = baseline / fused
                target = TARGETS.get(n) if args.device == "cpu" and args.threads == 1 else None
                verdict = "" if target is None else ("ok" if speedup >= target else "MISS")
                print("{:>5} {:>6} {:>4} | {:>10.3f} {:>10.3f} {:>7.2f}x | {:>10.3f} {:>7.2f}x | {:>6}".format(
                    rows, V, n, fused * 1e3, baseline * 1e3, speedup, floor * 1e3, fused / floor,
                    verdict + (" ({:.1f}x)".format(target) if target else "")), flush=True)
                results.append(dict(rows=rows, V=V, n=n, models=args.models, fused_s=fused, baseline_s=baseline,
                                    topk_s=floor, speedup=speedup, target=target))
            del members, logits
    targeted = [r for r in results if r["target"] is not None]
    if targeted:
        missed = [r for r in targeted if r["speedup"] < r["target"]]
        print("targets (speedup over log_softmax + topk, CPU 1 thread: >= 2x for n <= 10, >= 1.5x at n = 100): "
              "{} of {} met{}".format(len(targeted) - len(missed), len(targeted),
                                      "" if not missed else "; missed: " + ", ".join(
                                          "rows={rows} V={V} n={n} ({speedup:.2f}x)".format(**r) for r in missed)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, where=where, threads=args.threads, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
