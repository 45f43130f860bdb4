"""Where a decode's time went, from a ``perf record`` of the whole process: the decode window's samples by kind.

A sampling profile of a whole ``fairseq-generate`` (or CTranslate2) run
includes the start, the model's loading and the output; this keeps the
samples of the last ``--decode-s`` seconds before the last sample (less
``--tail-s``, the time after the decode) and sums them by kind of work:
the products (our int8 tiles, MKL's sgemm, oneDNN's JIT code as perf sees
it, CTranslate2's quantization), their dequantization, attention, the
output layer's softmax and top-k, Python, memory copies, the kernel. Then
the window's top symbols. Used for issue 50's one-core comparison with
CTranslate2 on the AVX2 EPYC (docs/threads.md):

    OMP_NUM_THREADS=1 perf record -F 499 -g -o ours.data -- taskset -c 0 fairseq-generate ... --cpu-threads 1
    python benchmarks/perf_window.py ours.data --decode-s 13.33 --tail-s 0.3 > ours.txt
"""

import argparse
import re
import subprocess
import sys
from collections import Counter

# (kind, test on (shared object, symbol)); the first that matches names a sample's kind.
KINDS = [
    ("products", lambda dso, sym: "[JIT]" in dso or "tile_at" in sym or "mkl_blas" in sym
     or "quantized_product" in sym or "quantize_s8" in sym or "skinny" in sym or "avx2::block" in sym),
    ("dequantization", lambda dso, sym: "dequantize" in sym),
    ("attention", lambda dso, sym: "attend" in sym or "attention" in sym.lower()),
    ("softmax and top-k", lambda dso, sym: any(s in sym for s in ("softmax", "TopK", "run_row", "TopN", "CachedRows"))),
    ("python", lambda dso, sym: "libpython" in dso),
    ("memory copies", lambda dso, sym: any(s in sym for s in ("memmove", "memset", "memcpy"))),
    ("the kernel", lambda dso, sym: "kernel" in dso),
    ("torch's other ops", lambda dso, sym: "libtorch" in dso or "libc10" in dso),
]
LINE = re.compile(r"\s+([\d.]+)%\s+(.+?)\s+\[[.k]\]\s+(.*)")


def perf(*argv) -> str:
    return subprocess.run(["perf"] + list(argv), capture_output=True, text=True, check=True).stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a perf.data file")
    parser.add_argument("--decode-s", type=float, required=True, help="the decode window's length")
    parser.add_argument("--tail-s", type=float, default=0.3, help="seconds from the window's end to the last sample")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    times = perf("script", "-i", args.data, "-F", "time").split()
    last = float(times[-1].rstrip(":"))
    window = "{:.6f},{:.6f}".format(last - args.tail_s - args.decode_s, last - args.tail_s)
    report = perf("report", "-i", args.data, "--time", window, "--no-children", "--sort", "dso,symbol", "--stdio")
    lines = report.splitlines()
    samples = next((line.lstrip("# ") for line in lines if line.startswith("# Samples")), "?")
    kinds, rows = Counter(), []
    for line in lines:
        found = LINE.match(line)
        if not found:
            continue
        share, dso, sym = float(found.group(1)), found.group(2).strip(), found.group(3).strip()
        kind = next((k for k, test in KINDS if test(dso, sym)), "other")
        kinds[kind] += share
        rows.append((share, dso, sym))
    print("{}: the last {:.2f} s before the last {:.2f} s ({} of {} samples)".format(
        args.data, args.decode_s, args.tail_s, samples, len(times)))
    for kind, share in kinds.most_common():
        print("{:6.1f}%  {:>6.2f} s  {}".format(share, share / 100 * args.decode_s, kind))
    print("\ntop symbols:")
    for share, dso, sym in rows[:args.top]:
        print("{:6.2f}%  {}  {}".format(share, dso, sym[:110]))


if __name__ == "__main__":
    sys.exit(main())
