"""int16 linear layer micro-benchmark (issue 14, part 1): the packed int16 kernel against float32.

Per (rows, out, in), the time of one ``y = x W^T + b``:

* ``fp32``: ``torch.nn.functional.linear`` (MKL's sgemm), what fairseq's LSTM runs today;
* one column per int16 kernel this CPU runs (``fairseq_stream.ops.int16_linear.kernels()``:
  ``portable`` loops, ``avx2`` ``vpmaddwd``, ``avx512vnni`` ``vpdpwssd``), the whole call (quantizing x,
  the int32 products, dequantizing).

The shapes are the Multi30k LSTM's of ``scripts/train_multi30k.sh --lstm`` (hidden and embeddings
256: the LSTM cell's 1024 x 256 products and the 256-wide output layer over the ~10k-word
vocabulary) and, for scale, Devlin's 1024-wide GRU (3072 x 1024). Rows: 1 (one hypothesis), 5 (a
beam), 50 and 250 (batched beams). Every int16 result is checked to equal the torch reference
(the same integer arithmetic) as it runs. Each time is the best of ``--repeats`` rounds of at
least ``--min-time`` seconds, after a warm-up call (``bench_output_layer.timer``).

    OMP_NUM_THREADS=1 python benchmarks/bench_int16_kernel.py [--rows 1 5 50 250] [--json FILE]
"""

import preamble  # noqa: F401  (first: the import paths)

import argparse
import json
import sys

import torch

from bench_output_layer import cpu_name, timer
from fairseq_stream.ops import int16_linear as L

SHAPES = [(1024, 256, "LSTM cell, 4H x H (H=256)"), (10000, 256, "output layer, V x 256"),
          (3072, 1024, "GRU cell, 3H x H (H=1024)")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 50, 250])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.2)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if L.kernel() == "torch":
        sys.exit("bench_int16_kernel: the compiled extension is not built (python setup.py build_ext --inplace)")
    measure = timer("cpu")
    g = torch.Generator().manual_seed(0)
    kernels = L.kernels()
    print("int16 kernels: {} (default {}); torch {}, {} thread(s), {}".format(
        ", ".join(kernels), L.kernel(), torch.__version__, args.threads, cpu_name()))
    print("{:>5} {:>6} {:>5}  {:>9} ".format("rows", "out", "in", "fp32 ms")
          + " ".join("{:>11} {:>7}".format(k[:7] + " ms", "vs fp32") for k in kernels) + "  shape")
    results = []
    for out_f, in_f, label in SHAPES:
        w = torch.randn(out_f, in_f, generator=g) * in_f ** -0.5
        b = torch.randn(out_f, generator=g) * 0.1
        p = L.pack(w, b)
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=g)
            fp32 = measure(lambda: torch.nn.functional.linear(x, w, b), args.repeats, args.min_time)
            row = dict(rows=rows, out=out_f, inp=in_f, shape=label, fp32_ms=fp32 * 1e3, int16_ms={}, speedup={})
            for k in kernels:
                assert torch.equal(L.int16_linear(x, p, kernel=k), L.reference(x, p)), k
                t = measure(lambda: L.int16_linear(x, p, kernel=k), args.repeats, args.min_time)
                row["int16_ms"][k], row["speedup"][k] = t * 1e3, fp32 / t
            results.append(row)
            print("{:>5} {:>6} {:>5}  {:>9.4f} ".format(rows, out_f, in_f, fp32 * 1e3)
                  + " ".join("{:>11.4f} {:>6.2f}x".format(row["int16_ms"][k], row["speedup"][k]) for k in kernels)
                  + "  " + label, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(kernel=L.kernel(), kernels=kernels, cpu=cpu_name(), threads=args.threads, torch=torch.__version__, results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
