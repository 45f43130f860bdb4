"""The compiled search loop and the lean runner's reorder: wall clock and process CPU time, one CPU thread.

Times ``BeamDecoder.generate`` on the configurations that run
``ops/csrc/cpu/search_loop_cpu.cpp`` (greedy and fixed k=5, one sentence at a
time and in batches) and two that run the Python loop, whose reorders move the
lean runner's caches (fixed k=5 with the compiled loop off, var-batch k=5),
interleaved for ``--rounds`` rounds; prints each one's median wall clock and
process CPU time (less sensitive than the wall clock to other processes on a
shared machine). Before and after a change: run it from each checkout in turn
(the script imports the checkout it sits in).

    python benchmarks/bench_compiled_loop.py MODEL_DIR [--checkpoints transformer/checkpoint_best.pt] \\
        [--subset valid] [--rounds 3] [--only "greedy b1,fixed5 b64"]

MODEL_DIR holds data-bin/ and the checkpoints (the toy: ``python scripts/toy_cache.py`` prints it).
"""

import preamble  # first: the import paths, then the threads before torch starts its pools

preamble.set_threads(1)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench_output_layer import cpu_name  # noqa: E402
from bench_search import load, make_batches  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.search.pruning import Pruning  # noqa: E402


def decoders(models, task):
    """{name: (decoder, batch size)}: the compiled loop's searches and the Python loop's."""
    def make(beam, compiled=True, **search):
        d = BeamDecoder(models, task.target_dictionary, beam_size=beam, runner="lean", output_layer="auto",
                        keep_reference=False, **search)
        d.compiled_loop = compiled
        return d

    var_batch = dict(finalize="stay", pruning=Pruning(ap=1.5, mc=5))
    return {"greedy b64": (make(1), 64), "greedy b1": (make(1), 1), "fixed5 b64": (make(5), 64),
            "fixed5 b1": (make(5), 1), "fixed5 b64 python loop": (make(5, False), 64),
            "var-batch5 b64 python loop": (make(5, False, **var_batch), 64)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--subset", default="valid")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models, task = load(args.model_dir, args.checkpoints)
    configs = decoders(models, task)
    if args.only:
        configs = {name: configs[name] for name in args.only.split(",")}
    batches = {size: make_batches(task, args.subset, size, 0) for size in {b for _, b in configs.values()}}
    wall = {name: [] for name in configs}
    cpu = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (decoder, size) in configs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for sample in batches[size]:
                decoder.generate(models, sample)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    print("machine: {}; torch {}; one thread; {}, {} rounds".format(cpu_name(), torch.__version__, args.checkpoints,
                                                                    args.rounds))
    print("| configuration | wall s (median) | CPU s (median) |")
    print("| --- | ---: | ---: |")
    for name in configs:
        print("| {} | {:.3f} | {:.3f} |".format(name, statistics.median(wall[name]), statistics.median(cpu[name])))


if __name__ == "__main__":
    main()
