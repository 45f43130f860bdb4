"""The static-slot runner against the lean runner on the CPU: wall clock of whole decodes, one thread.

Runners: ``lean`` (today's default for transformers), ``static`` (compiled
attention kernels), ``static-torch`` (the torch attention: CUDA's path) and
``static-buckets`` (torch attention, rows padded to 8/16/32/64/128, keys to
multiples of 16: what a CUDA graph would replay). Searches: greedy, fixed
k=5 (batch), var-batch k=5 (batch) and var-stream k=5 (the stream pool,
ε=1/6). Each decode is timed in interleaved rounds; the median is printed.
The output of every static variant is checked against the lean runner's
(same best hypothesis tokens per sentence).

    python benchmarks/bench_static.py [--model toy|PATH --data DATA_BIN] [--subset valid] [--repeats 3]
"""

import preamble  # noqa: F401  (first: the import paths)

import argparse
import os
import statistics
import subprocess
import sys
import time

preamble.set_threads(1)

import torch  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.schedule.pool import StreamPool  # noqa: E402
from fairseq_stream.search.pruning import Pruning  # noqa: E402

SEARCHES = {
    "greedy": (dict(beam_size=1), False),
    "fixed k=5": (dict(beam_size=5, finalize="fairseq"), False),
    "var-batch k=5": (dict(beam_size=5, finalize="stay", pruning=True), False),
    "var-stream k=5": (dict(beam_size=5, finalize="stay", pruning=True), True),
}
RUNNERS = {
    "lean": ("lean", {}),
    "static": ("static", {}),
    "static-torch": ("static", dict(compiled_attention=False)),
    "static-buckets": ("static", dict(compiled_attention=False, row_buckets=(8, 16, 32, 64, 128),
                                      length_bucket=16)),
}


def load(model, data, subset):
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task([model], arg_overrides={"data": data})
    for m in models:
        m.eval()
    task.load_dataset(subset)
    itr = task.get_batch_iterator(dataset=task.dataset(subset), max_sentences=64, required_batch_size_multiple=1,
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    return models, task, list(itr)


def decoder(models, task, runner, search):
    kind, settings = RUNNERS[runner]
    opts = dict(SEARCHES[search][0])
    if opts.pop("pruning", False):
        opts["pruning"] = Pruning(ap=1.5, mc=5)
    dec = BeamDecoder(models, task.target_dictionary, runner=kind, keep_reference=False, **opts)
    for name, value in settings.items():
        setattr(dec.runner, name, value)
    return dec


def run(dec, models, batches, stream):
    start = time.perf_counter()
    with torch.no_grad():
        if stream:
            pool = StreamPool(dec, 64, eps=1 / 6)
            out = dict(pool.run(dec.open(s["net_input"], ids=s["id"]) for s in batches))
        else:
            out = {i: h for s in batches for i, h in zip(s["id"].tolist(), dec.generate(models, s))}
    return time.perf_counter() - start, {i: h[0]["tokens"].tolist() for i, h in out.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy", help="checkpoint, or 'toy' (the test suite's toy transformer)")
    parser.add_argument("--data", help="data-bin (default: the toy's)")
    parser.add_argument("--subset", default="valid")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, data = args.model, args.data
    if model == "toy":
        sys.path.insert(0, os.path.join(preamble.REPO, "scripts"))
        import toy_cache

        root = str(toy_cache.ensure())
        model, data = os.path.join(root, "transformer", "checkpoint_best.pt"), os.path.join(root, "data-bin")
    models, task, batches = load(model, data, args.subset)
    print("cpu: {}; load before: {}".format(_cpu(), _uptime()))
    times = {(r, s): [] for r in RUNNERS for s in SEARCHES}
    outputs = {}
    for _ in range(args.repeats):
        for search, (_, stream) in SEARCHES.items():
            for runner in RUNNERS:
                seconds, outputs[runner, search] = run(decoder(models, task, runner, search), models, batches, stream)
                times[runner, search].append(seconds)
    sentences = sum(b["id"].numel() for b in batches)
    print("{} sentences of {}, one thread, median of {} interleaved rounds (seconds)".format(
        sentences, args.subset, args.repeats))
    print("{:16s}".format("search") + "".join("{:>16s}".format(r) for r in RUNNERS))
    for search in SEARCHES:
        lean = outputs["lean", search]
        cells = []
        for r in RUNNERS:
            same = sum(outputs[r, search][i] == lean[i] for i in lean)
            cells.append("{:.2f}{}".format(statistics.median(times[r, search]),
                                          "" if same == len(lean) else " ({} differ)".format(len(lean) - same)))
        print("{:16s}".format(search) + "".join("{:>16s}".format(c) for c in cells))
    print("load after: {}".format(_uptime()))


def _cpu() -> str:
    from fairseq_stream.cpu_info import describe

    return describe()


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
