"""The lean runner's float32 products at few rows: the skinny product against MKL's, on a model's own weights.

A decoder step of one sentence multiplies 1 to 5 rows (a greedy step, a
Jacobi window, a beam of 5) by every weight of the decoder and by the output
layer; those products are bound by reading the weights. Per weight shape of
the model (one of each) and per row count, the median over interleaved
rounds of:

* ``lean``: what the lean runner calls (the float32 ``Product``): the skinny
  product (``csrc/cpu/skinny_linear_cpu.cpp``) at 1 to ``skinny_rows()``
  rows where the CPU has AVX2 and FMA (AVX-512 or AVX2 tiles), MKL's otherwise;
* ``mkl``: MKL's product alone (``Product.mkl_product``: unpacked at
  2 and 3 rows, packed otherwise), what the runner called before;
* ``F.linear``: torch's product on the weight;
* ``onednn`` (``--onednn``): oneDNN's float32 product on the weight packed
  once for the call's rows (torch's ``mkldnn._linear_pointwise``), the
  SGEMM CTranslate2 runs on CPUs that are not Intel's.

Then the decoder's products summed per step (every layer's, the output
layer's), the part of a batch-1 step that the skinny product changes.

    python benchmarks/bench_products.py /work/m30k/probe [--checkpoints transformer/checkpoint_best.pt] \\
        [--rows 1 2 3 4 5 6 8] [--rounds 7] [--threads 1] [--json FILE]
"""

import preamble  # first: the import paths (main sets the threads before it imports torch)

import argparse
import json
import statistics
import sys
import time


PRODUCTS = ("qkv", "self_out", "cross_q", "cross_out", "fc1", "fc2")


def timed(f, x, calls: int) -> float:
    """Milliseconds a call, over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        f(x)
    return 1000 * (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; times are medians")
    parser.add_argument("--calls", type=int, default=200, help="calls per product and round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--onednn", action="store_true", help="also time oneDNN's packed float32 product")
    parser.add_argument("--json")
    args = parser.parse_args()
    preamble.set_threads(args.threads)

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    from bench_output_layer import cpu_name
    from bench_search import load
    from fairseq_stream.ops import product
    from fairseq_stream.runners.lean import LeanRunner

    models, _ = load(args.model_dir, args.checkpoints, "cpu")
    lean = LeanRunner(models).lean[0]
    if isinstance(lean.output, product.TorchLinear):
        sys.exit("no prepacked product here: " + product.missing_reason())
    layer = lean.layers[0]
    # One product of each shape, and how many of it a step runs.
    shapes = {"output": (lean.output, 1)}
    for name in PRODUCTS:
        shapes[name] = (getattr(layer, name), len(lean.layers))
    methods = {
        "lean": lambda p: p,
        "mkl": lambda p: p.mkl_product,
        "F.linear": lambda p: (lambda x: F.linear(x, p.weight, p.bias)),
    }
    if args.onednn:
        packed = {}

        def onednn(p):
            def call(x):
                key = (id(p), x.shape[0])
                if key not in packed:  # packed once per row count, as a caller would
                    packed[key] = torch.ops.mkldnn._reorder_linear_weight(p.weight.detach(), x.shape[0])
                bias = None if p.bias is None else p.bias.detach()
                return torch.ops.mkldnn._linear_pointwise(x, packed[key], bias, "none", [], "")
            return call

        methods["onednn"] = onednn
    print("device: {}, threads: {}, {} {}; skinny product up to {} rows, median of {} rounds".format(
        cpu_name(), args.threads, args.model_dir, args.checkpoints, product.skinny_rows(), args.rounds))
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
              " (mkl / lean {:.2f}x)".format(step["mkl"] / step["lean"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=cpu_name(), threads=args.threads, skinny_rows=product.skinny_rows(),
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
