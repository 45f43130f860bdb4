"""The static-slot runner against the lean runner on the CPU: wall clock of whole decodes, one thread.

Runners: ``lean`` (today's default for transformers), ``static`` (compiled
attention kernels), ``static-torch`` (the torch attention: CUDA's path) and
``static-buckets`` (torch attention, rows padded to 8/16/32/64/128, keys to
multiples of 16: what a CUDA graph would replay); for an ensemble
(``--members N``: the toy's transformer .. transformerN) the lean runner
and ``static`` run the members one after another and ``static-stacked``
(and ``static-stacked-torch``) stacked (runners/static_stacked.py). Searches: greedy, fixed
k=5 (batch), var-batch k=5 (batch) and var-stream k=5 (the stream pool,
ε=1/6). Each decode is timed in interleaved rounds; the median is printed.
The output of every static variant is checked against the lean runner's
(same best hypothesis tokens per sentence).

    python benchmarks/bench_static.py [--model toy|PATH --data DATA_BIN] [--members N] [--subset valid]
        [--repeats 3] [--runners lean static ...] [--searches greedy "fixed k=5" ...]
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
# name: (runner, stack_members, attributes set on the runner)
RUNNERS = {
    "lean": ("lean", False, {}),
    "static": ("static", False, {}),
    "static-torch": ("static", False, dict(compiled_attention=False)),
    "static-buckets": ("static", False, dict(compiled_attention=False, row_buckets=(8, 16, 32, 64, 128),
                                             length_bucket=16)),
    "static-stacked": ("static", True, {}),
    "static-stacked-torch": ("static", True, dict(compiled_attention=False)),
}


def load(paths, data, subset):
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(paths, arg_overrides={"data": data})
    for m in models:
        m.eval()
    task.load_dataset(subset)
    itr = task.get_batch_iterator(dataset=task.dataset(subset), max_sentences=64, required_batch_size_multiple=1,
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    return models, task, list(itr)


def decoder(models, task, runner, search):
    kind, stack, settings = RUNNERS[runner]
    opts = dict(SEARCHES[search][0])
    if opts.pop("pruning", False):
        opts["pruning"] = Pruning(ap=1.5, mc=5)
    dec = BeamDecoder(models, task.target_dictionary, runner=kind, keep_reference=False, stack_members=stack,
                      **opts)
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
    parser.add_argument("--members", type=int, default=1, help="with the toy: an ensemble of its first N "
                        "transformers (transformer, transformer2, .. transformer4)")
    parser.add_argument("--runners", nargs="+", choices=list(RUNNERS), default=list(RUNNERS)[:4])
    parser.add_argument("--searches", nargs="+", choices=list(SEARCHES), default=list(SEARCHES))
    args = parser.parse_args()
    paths, data = [args.model], args.data
    if args.model == "toy":
        sys.path.insert(0, os.path.join(preamble.REPO, "scripts"))
        import toy_cache

        root = str(toy_cache.ensure())
        names = ["transformer"] + ["transformer{}".format(i) for i in range(2, args.members + 1)]
        paths = [os.path.join(root, name, "checkpoint_best.pt") for name in names]
        data = os.path.join(root, "data-bin")
    models, task, batches = load(paths, data, args.subset)
    runners = ["lean"] + [r for r in args.runners if r != "lean"]  # the reference the others are checked against
    searches = {s: SEARCHES[s] for s in args.searches}
    print("cpu: {}; load before: {}".format(_cpu(), _uptime()))
    times = {(r, s): [] for r in runners for s in searches}
    outputs = {}
    for _ in range(args.repeats):
        for search, (_, stream) in searches.items():
            for runner in runners:
                seconds, outputs[runner, search] = run(decoder(models, task, runner, search), models, batches, stream)
                times[runner, search].append(seconds)
    sentences = sum(b["id"].numel() for b in batches)
    print("{} sentences of {}, {} model(s), one thread, median of {} interleaved rounds (seconds)".format(
        sentences, args.subset, len(models), args.repeats))
    print("{:16s}".format("search") + "".join("{:>22s}".format(r) for r in runners))
    for search in searches:
        lean = outputs["lean", search]
        cells = []
        for r in runners:
            same = sum(outputs[r, search][i] == lean[i] for i in lean)
            cells.append("{:.2f}{}".format(statistics.median(times[r, search]),
                                          "" if same == len(lean) else " ({} differ)".format(len(lean) - same)))
        print("{:16s}".format(search) + "".join("{:>22s}".format(c) for c in cells))
    print("load after: {}".format(_uptime()))


def _cpu() -> str:
    from fairseq_stream.cpu_info import describe

    return describe()


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
