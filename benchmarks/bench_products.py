"""The lean runner's float32 products at few rows: the skinny product against MKL's, on a model's own weights.

A decoder step of one sentence multiplies 1 to 5 rows (a greedy step, a
Jacobi window, a beam of 5) by every weight of the decoder and by the output
layer; those products are bound by reading the weights. Per weight shape of
the model (one of each) and per row count, the median over interleaved
rounds of:

* ``lean``: what the lean runner calls (the float32 ``Product``): the skinny
  product (``csrc/cpu/skinny_linear_cpu.cpp``) at 1 to ``skinny_rows()``
  rows where the CPU has AVX2 and FMA (AVX-512 or AVX2 tiles), the GEMM
  that ``product.float32_gemm`` chooses for the weight otherwise;
* ``mkl``: MKL's product alone (``Product.gemm_product`` of the weight
  packed for MKL: unpacked at 2 and 3 rows, packed otherwise);
* ``F.linear``: torch's product on the weight;
* ``onednn`` (``--onednn``): oneDNN's product alone (``gemm_product`` of the
  weight in oneDNN's blocked layout, torch's ``mkldnn._linear_pointwise``),
  the SGEMM CTranslate2 runs on CPUs that are not Intel's;
* ``whole`` (``--panels``): the lean product with its weight packed whole
  (``FAIRSEQ_STREAM_FLOAT32_PANELS=off``), where ``lean`` packs a weight of
  a few million values and up in panels of output columns
  (``csrc/cpu/prepacked_linear_cpu.cpp``: ``float32_panels``). With
  ``--kernel-threads N`` torch's ops run on one thread and our kernels on N,
  as in a decode (and glibc keeps freed memory, as a decode asks it to:
  ``fairseq_stream/malloc_policy.py``): there a call of up to 64 rows is one
  row block, which only the panels share among the threads.

Then the decoder's products summed per step (every layer's, the output
layer's), the part of a batch-1 step that the skinny product changes.

    python benchmarks/bench_products.py /work/m30k/probe [--checkpoints transformer/checkpoint_best.pt] \\
        [--rows 1 2 3 4 5 6 8] [--rounds 7] [--threads 1] [--onednn] [--panels] [--kernel-threads 2] [--json FILE]

``--shapes NAME=OUTxIN ...`` times weights of those shapes (Gaussian, with a
bias) in place of a model's, e.g. WMT'19's transformer-big without its
checkpoints: ``--shapes output=42024x1024 qkv=3072x1024 self_out=1024x1024
fc1=8192x1024 fc2=1024x8192`` (the step sums count each once).
"""

import preamble  # first: the import paths (main sets the threads before it imports torch)

import argparse
import json
import statistics
import sys
import time
from unittest import mock


PRODUCTS = ("qkv", "self_out", "cross_q", "cross_out", "fc1", "fc2")


def timed(f, x, calls: int) -> float:
    """Milliseconds a call, over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        f(x)
    return 1000 * (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", help="a trained model's directory (or --shapes)")
    parser.add_argument("--shapes", nargs="+", metavar="NAME=OUTxIN", help="weights of these shapes, no model")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; times are medians")
    parser.add_argument("--calls", type=int, default=200, help="calls per product and round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--onednn", action="store_true", help="also time oneDNN's float32 GEMM alone")
    parser.add_argument("--panels", action="store_true", help="also time the lean product with its weight whole")
    parser.add_argument("--kernel-threads", type=int, help="our kernels' threads, torch's ops on one (a decode's "
                        "layout); default: --threads for torch, our kernels' default")
    parser.add_argument("--json")
    args = parser.parse_args()
    if (args.model_dir is None) == (args.shapes is None):
        parser.error("give a model directory or --shapes, one of them")
    preamble.set_threads(1 if args.kernel_threads else args.threads)

    import os

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1 if args.kernel_threads else args.threads)
    if args.kernel_threads:
        from fairseq_stream import malloc_policy
        from fairseq_stream.ops.loader import compiled_module

        compiled_module("cpu").set_kernel_threads(args.kernel_threads)
        # As a decode's process: freed blocks kept for reuse, so that a call's outputs do not fault in fresh
        # pages each time (panels copy each block's result once more).
        malloc_policy.keep_freed_memory()
    from bench_search import load
    from fairseq_stream import cpu_info
    from fairseq_stream.ops import product
    from fairseq_stream.runners.lean import LeanRunner

    if not product.available():
        sys.exit("no prepacked product here: " + product.missing_reason())
    # One product of each shape, and how many of it a step runs.
    if args.shapes:
        shapes = {}
        g = torch.Generator().manual_seed(1)
        for spec in args.shapes:
            name, _, size = spec.partition("=")
            out_features, in_features = map(int, size.lower().split("x"))
            weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
            shapes[name] = (product.linear(weight, torch.randn(out_features, generator=g)), 1)
        source = " ".join(args.shapes)
    else:
        models, _ = load(args.model_dir, args.checkpoints, "cpu")
        lean = LeanRunner(models).lean[0]
        layer = lean.layers[0]
        shapes = {"output": (lean.output, 1)}
        for name in PRODUCTS:
            shapes[name] = (getattr(layer, name), len(lean.layers))
        source = "{} {}".format(args.model_dir, args.checkpoints)
    gemms = ["mkl"] + (["onednn"] if args.onednn else [])
    # Each shape's weight packed for each GEMM (the lean product keeps the one float32_gemm chooses).
    alone = {(id(p), gemm): product.linear(p.weight, p.bias, "float32", kernel=gemm).gemm_product
             for p, _ in shapes.values() for gemm in gemms}
    methods = {
        "lean": lambda p: p,
        "mkl": lambda p: alone[(id(p), "mkl")],
        "F.linear": lambda p: (lambda x: F.linear(x, p.weight, p.bias)),
    }
    if args.onednn:
        methods["onednn"] = lambda p: alone[(id(p), "onednn")]
    if args.panels:
        with mock.patch.dict(os.environ, {product.PANELS_VARIABLE: "off"}):  # read when a weight is packed
            whole = {id(p): product.linear(p.weight, p.bias, "float32", kernel=p.kernel) for p, _ in shapes.values()}
        methods["whole"] = lambda p: whole[id(p)]
    threads = ("our kernels {}, torch 1".format(args.kernel_threads) if args.kernel_threads else args.threads)
    print("device: {}, threads: {}, {}; skinny product up to {} rows, median of {} rounds".format(
        cpu_info.describe(), threads, source, product.skinny_rows(), args.rounds))
    print("lean's GEMM: " + ", ".join("{} {} ({} panel{})".format(name, p.kernel, len(p.panels),
                                                                  "s" if len(p.panels) > 1 else "")
                                      for name, (p, _) in shapes.items()))
    g = torch.Generator().manual_seed(0)
    inputs = {(name, rows): torch.randn(rows, p.in_features, generator=g)
              for name, (p, _) in shapes.items() for rows in args.rows}
    times = {}
    for _ in range(args.rounds):
        for (name, rows), x in inputs.items():
            p = shapes[name][0]
            for method, make in methods.items():
                f = make(p)
                f(x)
                times.setdefault((name, rows, method), []).append(timed(f, x, args.calls))
    ms = {key: statistics.median(v) for key, v in times.items()}
    results = []
    print("\nms a call, " + " / ".join(methods))
    print("{:<20}".format("weight") + "".join("{:>30}".format("{} row{}".format(r, "s" if r > 1 else ""))
                                           for r in args.rows))
    for name, (p, count) in shapes.items():
        cells = []
        for rows in args.rows:
            cells.append("/".join("{:.3f}".format(ms[(name, rows, m)]) for m in methods))
            results.append(dict(weight=name, out_features=p.out_features, in_features=p.in_features,
                                per_step=count, rows=rows, **{m: ms[(name, rows, m)] for m in methods}))
        print("{:<20}".format("{} {}x{}".format(name, p.out_features, p.in_features)) +
              "".join("{:>30}".format(c) for c in cells))
    print("\na step's products (every layer's and the output layer's), ms, lean / mkl:")
    for rows in args.rows:
        step = {m: sum(ms[(name, rows, m)] * count for name, (_, count) in shapes.items()) for m in methods}
        print("  {} rows: ".format(rows) + " / ".join("{} {:.3f}".format(m, step[m]) for m in methods) +
              " (mkl / lean {:.2f}x{})".format(step["mkl"] / step["lean"], ", whole / lean {:.2f}x".format(
                  step["whole"] / step["lean"]) if "whole" in step else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=cpu_info.describe(), threads=args.threads, kernel_threads=args.kernel_threads,
                           skinny_rows=product.skinny_rows(),
                           lean_gemm={name: p.kernel for name, (p, _) in shapes.items()},
                           lean_panels={name: len(p.panels) for name, (p, _) in shapes.items()}, results=results),
                      f, indent=1)


if __name__ == "__main__":
    main()
