"""Where the time of one decoding pass goes: cProfile of our loop on the Multi30k model.

    python benchmarks/profile_decode.py MODEL_DIR [--device cuda] [--method var-batch] [--beam 5]

Prints the wall clock, the decoder calls, and the functions with the most
time of their own. With ``--kernels`` on a GPU it also totals the time the
device spent in kernels (torch.profiler): whether the device or the host is
the bottleneck.
"""

import preamble  # noqa: F401  (first: the import paths)

import argparse
import cProfile
import pstats
import time

import torch

from bench_search import load, make_batches, synchronize
from bench_stream import decode_batch, decode_stream

from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.search.pruning import Pruning

METHODS = {  # name -> stream arguments (None: batch)
    "var-batch": None,
    "var-stream": (1 / 6, "sentences", "shortest", None),
    "var-stream-rows": (1 / 6, "rows", "shortest", None),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--method", choices=sorted(METHODS), default="var-batch")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--runner", choices=("fairseq", "lean"), default="fairseq")
    parser.add_argument("--output-layer", choices=("auto", "torch", "fused"), default="auto",
                        help="as fairseq-generate's option (auto: the fused kernel where it is built)")
    parser.add_argument("--kernels", action="store_true", help="CUDA: also total the GPU's kernel time")
    args = parser.parse_args()

    torch.set_num_threads(1)
    models, task = load(args.model_dir, args.checkpoints, args.device)
    batches = make_batches(task, "test", args.batch_size, args.limit, args.device)
    stream = METHODS[args.method]

    def run():
        dec = BeamDecoder(models, task.target_dictionary, beam_size=args.beam, finalize="stay",
                          pruning=Pruning(ap=1.5, mc=5), runner=args.runner, output_layer=args.output_layer)
        with torch.no_grad():
            if stream is None:
                decode_batch(dec, models, batches)
            else:
                decode_stream(dec, batches, args.batch_size, *stream)
        synchronize(args.device)
        return dec.stats

    run()  # warm-up
    start = time.perf_counter()
    stats = run()
    wall = time.perf_counter() - start
    print("{} k={} n={} on {}: {:.2f} s, {} decoder calls, {:.2f} ms per call".format(
        args.method, args.beam, args.batch_size, args.device, wall, stats.timesteps,
        1000 * wall / stats.timesteps))
    profiler = cProfile.Profile()
    profiler.runcall(run)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    if args.kernels and torch.device(args.device).type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
        print("GPU busy in kernels: {:.2f} s of a {:.2f} s pass".format(busy, wall))


if __name__ == "__main__":
    main()
