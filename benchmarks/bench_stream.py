"""Streaming benchmark (Yang et al. 2020, Tables 1, 3, 5 and Figure 2), side by side in one process.

Greedy, fairseq's beam search, FIXED (our fixed, fairseq finalization) and
FIXED-STREAM, VAR-BATCH, VAR-STREAM and VAR-STR-FIFO (for each ε, ε counting
sentences as in the paper) and VAR-STREAM with ε counting live rows, with and
without the paper's capacity of n·k candidates per step, decode the same
fairseq batches of the same model on one device (``--device cpu|cuda``).
VAR-STREAM runs with each ``--max-wait`` latency guard (by default the
plugin's default and none), so the table states what the guard costs; "peak
lag" is the most decoder calls any sentence was passed over.
Wall clock is the median of ``--repeats`` full passes, taken in interleaved
rounds (each round runs every method once). Every streamed
run is checked against its batch counterpart: the best hypothesis of every
sentence must have the same tokens (the table says so, or how many differ).

    python benchmarks/bench_stream.py MODEL_DIR --refs REFS [--beams 5 50] [--plots DIR]

Plots (``--plots``): median decoder-step time against current prefix length
(the paper's Figure 2) and rows per decoder call over the run, for VAR-BATCH
and VAR-STREAM (ε = 1/6).
"""

import preamble  # noqa: F401  (first: the import paths)

import argparse
import json
import os
import statistics
import sys
import time
from fractions import Fraction

import sentencepiece as spm
import torch

from bench_search import RowCounter, add_input_arguments, bleu, load, make_batches, synchronize
from fairseq.sequence_generator import SequenceGenerator

from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.schedule.pool import DEFAULT_MAX_WAIT, StreamPool
from fairseq_stream.search.pruning import Pruning


def decode_batch(generator, models, batches):
    out = {}
    for sample in batches:
        out.update(zip(sample["id"].tolist(), generator.generate(models, sample)))
    return out


def decode_stream(decoder, batches, pool_size, eps, unit, order="shortest", capacity=None,
                  max_wait=DEFAULT_MAX_WAIT):
    pool = StreamPool(decoder, pool_size, eps=eps, refill_unit=unit, order=order, capacity=capacity,
                      max_wait=max_wait)
    return dict(pool.run(decoder.open(s["net_input"], ids=s["id"]) for s in batches))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_arguments(parser)
    parser.add_argument("--eps", nargs="+", default=["1/12", "1/6", "1/4"])
    parser.add_argument("--rows-eps", nargs="*", default=["1/6"],
                        help="ε values for VAR-STREAM with ε counting live rows (none: skip)")
    parser.add_argument("--max-wait", type=int, nargs="+", default=[DEFAULT_MAX_WAIT, 0],
                        help="latency guards (--stream-max-wait) to run var-stream with, each ε; the other "
                        "streamed methods use the first (default: the plugin's default and 0, no guard)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="n: batch size and pool size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--limit", type=int, default=0, help="only sentences with id < LIMIT")
    parser.add_argument("--no-greedy", action="store_true")
    parser.add_argument("--no-fixed", action="store_true", help="skip fairseq beam, FIXED and FIXED-STREAM")
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--plots", help="write the two plots into this directory")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    models, task = load(args.model_dir, args.checkpoints, args.device)
    d = task.target_dictionary
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "spm", "spm.model"))
    refs = open(args.refs, encoding="utf-8").read().splitlines()
    batches = make_batches(task, args.subset, args.batch_size, args.limit, args.device)
    n_sent = sum(len(b["id"]) for b in batches)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "{} thread(s)".format(args.threads)
    print("{} sentences, n = {}, {}, median of {} runs, {}".format(
        n_sent, args.batch_size, where, args.repeats, time.strftime("%Y-%m-%d")), flush=True)
    print("| method | k | ε | BLEU | wall clock (s) | timesteps | expansions | exp./step | peak lag | same tokens as |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)

    rows, outputs, step_logs = [], {}, {}
    plan = []  # (name, beam, eps, run, reference), measured in interleaved rounds

    def measure(name, beam, eps, run, stats_of, reference=None):
        plan.append((name, beam, eps, run, stats_of, reference))

    def execute():
        # Every round runs each method once, so slow drift of the machine
        # (a shared VM) affects all methods alike; the median is per method.
        # On a GPU, per-step times need a synchronization per step, which
        # would slow the run it is taken in: there the step log comes from
        # an extra, untimed round (on the CPU the last timed round keeps it).
        cuda = torch.device(args.device).type == "cuda"
        rounds = args.repeats + (1 if cuda else 0)
        walls = {i: [] for i in range(len(plan))}
        last = {}
        if cuda:
            with torch.no_grad():  # CUDA context, kernels and allocator warmed before timing
                plan[0][3](keep_steps=False)
        for rep in range(rounds):
            keep_steps = rep == rounds - 1
            timed = not (cuda and keep_steps)
            for i, (name, beam, eps, run, stats_of, reference) in enumerate(plan):
                synchronize(args.device)
                start = time.perf_counter()
                with torch.no_grad():
                    last[i] = run(keep_steps=keep_steps)
                synchronize(args.device)
                if timed:
                    walls[i].append(time.perf_counter() - start)
                    # Progress on stderr: a run cut short still shows its timings.
                    print("round {} | {} k={} eps={} | {:.2f} s".format(rep + 1, name, beam, eps or "-",
                                                                    walls[i][-1]), file=sys.stderr, flush=True)
        for i, (name, beam, eps, run, stats_of, reference) in enumerate(plan):
            out, stats = last[i]
            report(name, beam, eps, out, stats, stats_of, reference, walls[i])

    def report(name, beam, eps, out, stats, stats_of, reference, walls):
        outputs[(name, beam, eps)] = {sid: hyps[0]["tokens"] for sid, hyps in out.items()}
        s = stats_of(stats)
        if stats.keep_steps:
            step_logs[(name, beam, eps)] = stats.steps
        same = ""
        if reference is not None:
            ref = outputs[reference]
            differ = sum(not torch.equal(ref[i], outputs[(name, beam, eps)][i]) for i in ref)
            same = "{}: {}".format(reference[0], "all" if differ == 0 else "{} differ".format(differ))
        row = {
            "method": name, "k": beam, "eps": eps or "",
            "bleu": round(bleu(outputs[(name, beam, eps)], task, sp, refs), 2),
            "wall_s": round(statistics.median(walls), 2), "walls": [round(w, 2) for w in walls],
            "timesteps": s["timesteps"], "expansions": s["expansions"],
            "expansions_per_step": round(s["expansions_per_step"], 1), "same_tokens": same,
            "refills": s.get("refills", 0), "peak_lag": s.get("peak_lag", 0),
        }
        rows.append(row)
        print("| {method} | {k} | {eps} | {bleu:.2f} | {wall_s:.2f} | {timesteps} | {expansions} | "
              "{expansions_per_step} | {peak_lag} | {same_tokens} |".format(**row), flush=True)

    def ours(beam, finalize, pruning, stream=None):
        def run(keep_steps):
            dec = BeamDecoder(models, d, beam_size=beam, finalize=finalize, pruning=pruning)
            dec.stats.keep_steps = keep_steps
            if stream is None:
                return decode_batch(dec, models, batches), dec.stats
            return decode_stream(dec, batches, args.batch_size, *stream), dec.stats
        return run

    def fairseq(beam):
        def run(keep_steps):
            with RowCounter() as counter:
                out = decode_batch(SequenceGenerator(models, d, beam_size=beam), models, batches)
            return out, counter.stats
        return run

    summary = lambda stats: stats.summary()  # noqa: E731
    if not args.no_greedy:
        measure("greedy", 1, None, ours(1, "fairseq", None), summary)
    var = Pruning(ap=1.5, mc=5)
    for beam in args.beams:
        if not args.no_fixed:
            measure("fairseq beam", beam, None, fairseq(beam), summary)
            measure("fixed", beam, None, ours(beam, "fairseq", None), summary)
            measure("fixed-stream", beam, "1/6", ours(beam, "fairseq", None, (1 / 6, "sentences")), summary,
                    reference=("fixed", beam, None))
        measure("var-batch", beam, None, ours(beam, "stay", var), summary)
        guard = args.max_wait[0]
        runs = [(guard_name("var-stream", wait), eps, "sentences", "shortest", None, wait)
                for wait in args.max_wait for eps in args.eps]
        runs += [(guard_name("var-fifo", guard), eps, "sentences", "fifo", None, guard) for eps in args.eps]
        runs += [(guard_name("var-stream (rows)", guard), eps, "rows", "shortest", None, guard)
                 for eps in args.rows_eps]
        # The paper's capacity setting (§4.2): at most n·k candidates per step.
        runs += [(guard_name("var-stream (rows, cap nk)", guard), eps, "rows", "shortest",
                  args.batch_size * beam, guard) for eps in args.rows_eps]
        for name, eps, unit, order, capacity, wait in runs:
            stream = (float(Fraction(eps)), unit, order, capacity, wait)
            measure(name, beam, eps, ours(beam, "stay", var, stream), summary,
                    reference=("var-batch", beam, None))

    execute()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sentences": n_sent, "batch_size": args.batch_size, "threads": args.threads,
                       "device": where,
                       "repeats": args.repeats, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    if args.plots:
        plot(step_logs, args.plots)


def guard_name(method, max_wait):
    """A streamed method's name in the table; the plugin's default guard goes unnamed."""
    if max_wait == DEFAULT_MAX_WAIT:
        return method
    return "{}, {}".format(method, "no guard" if max_wait == 0 else "guard {}".format(max_wait))


def plot(step_logs, directory):
    """Figure 2 (median step time by prefix length) and rows per decoder call over the run."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    chosen = {key: steps for key, steps in step_logs.items()
              if key[0] in ("var-batch", "var-stream", "var-fifo", "var-stream (rows)", "var-stream (rows, cap nk)")
              and key[2] in (None, "1/6")}

    def figure(beam, size, linewidth, xlabel, ylabel, title, name, series):
        fig, ax = plt.subplots(figsize=size)
        for (method, k, eps), steps in sorted(chosen.items(), key=lambda kv: kv[0][0]):
            if k == beam:
                ax.plot(*series(steps), label=method, linewidth=linewidth)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title.format(beam))
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(directory, name.format(beam)), dpi=120)
        plt.close(fig)

    def by_length(steps):
        times = {}
        for length, _, sec in steps:
            times.setdefault(length, []).append(sec)
        lengths = sorted(times)
        return lengths, [1000 * statistics.median(times[x]) for x in lengths]

    def over_run(steps):
        return range(len(steps)), [rows for _, rows, _ in steps]

    for beam in sorted({key[1] for key in chosen}):
        figure(beam, (6, 4), 1.5, "current prefix length $l_t$", "median decoder-step time (ms)",
               "Step time by length, k={}", "step_time_by_length_k{}.png", by_length)
        figure(beam, (7, 4), 0.8, "decoder call", "rows (hypotheses expanded)",
               "Rows per decoder call, k={}", "rows_per_step_k{}.png", over_run)


if __name__ == "__main__":
    main()
