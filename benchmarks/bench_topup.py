"""Top-up batching, maxi-batching and the encoder thread against mini-batching, on short and long inputs.

One process, one model (the Multi30k transformer: spm/, data-bin/, transformer/),
``--threads`` CPU threads. Each input (raw source text, one sentence a line:
the Multi30k test set, short sentences; newstest2017 De-En, long ones) is
encoded with the model's sentencepiece and cut into batches of
``--batch-size`` sentences in one of three ways:

* ``mini``: input order, unsorted (``Translator(maxi_batch=1)``: what a
  service or fairseq-interactive without a buffer does; the paper's
  mini-batching);
* ``maxi``: windows of ``--maxi-batch`` m x batch-size sentences, each sorted
  by length, then cut (Marian's maxi-batching, m = 100 by default as in
  Marian);
* ``full``: the whole input sorted, as fairseq-generate does.

Methods, at each beam in ``--beams`` (greedy for k = 1, fixed ``--finalize
fairseq`` otherwise; all on the lean runner and fused output layer, so that
only the scheduling differs):

* ``mini``, ``maxi``, ``full``: batch decoding of those batches;
* ``topup`` / ``topup+maxi``: the pool in FIFO order refilled at 1/2
  (``--generator topup``) over mini / maxi batches, pool = batch size;
* ``topup+enc`` / ``topup+maxi+enc``: the same with the encoder running ahead
  in its thread (``--encoder-queue 2``);
* ``var-stream`` (k > 1), for reference: VAR-STREAM (delta = 1.5, M = 5,
  eps = 1/6) over maxi batches;
* with ``--compare-joins``, ``topup-apart`` / ``topup+maxi-apart``: top-up
  with the cohorts of different refills kept apart (one search update each
  per call), as before they were joined into one
  (``StreamPool(join_lengths=False)``).

Reported: wall clock (median of ``--repeats`` interleaved rounds), decoder
calls, the share of calls that ran fewer than 8 sentences (the paper's
Figure 8 measure; var-stream's rows are hypotheses, not sentences: not
reported), and whether every sentence's best hypothesis equals the batch
decoding of the same batches (top-up against ``mini``, ``topup+maxi``
against ``maxi``); and the decoder rows run and the seconds spent inside
the runner's forward passes (median; the search and the scheduling are
outside them), per row: every method runs the same rows, so a difference
there is a difference in what a row costs in calls of other sizes.
``--plot DIR`` draws the sentences per decoder call over
the run (the paper's Figure 2) for mini, maxi and top-up at the largest beam.

    python benchmarks/bench_topup.py /work/m30k/probe \\
        --inputs /work/shared/data/multi30k/test_2016_flickr.de /work/shared/data/wmt/de-en/newstest2017.de \\
        [--limit 1000] [--beams 1 5] [--repeats 3] [--threads 1] [--plot DIR] [--json FILE]
"""

import preamble  # first: the import paths, then the threads before torch starts its pools

preamble.set_threads(1, keep_given=True)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402

from bench_search import load  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.schedule.pool import StreamPool  # noqa: E402
from fairseq_stream.schedule.read_ahead import read_ahead  # noqa: E402
from fairseq_stream.search.pruning import Pruning  # noqa: E402


def encode_lines(task, sp, path, limit):
    """The first ``limit`` lines of ``path`` as source token tensors (EOS last), cut to the model's positions."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f][: limit or None]
    d = task.source_dictionary
    tokens = [d.encode_line(" ".join(sp.encode(line, out_type=str)), add_if_not_exist=False).long() for line in lines]
    max_len = min(task.max_positions()) if isinstance(task.max_positions(), tuple) else task.max_positions()
    tokens = [t[: max_len - 1].clone() if t.numel() > max_len else t for t in tokens]
    for t in tokens:
        t[-1] = d.eos()
    return tokens


def batches_of(task, tokens, batch_size, batching, maxi_batch):
    """Batches of ``tokens`` (ids = input positions): ``mini`` (input order), ``maxi`` or ``full`` (sorted)."""
    order = list(range(len(tokens)))
    if batching == "full":
        order.sort(key=lambda i: tokens[i].numel())
    elif batching == "maxi":
        window = batch_size * maxi_batch
        order = [i for w in range(0, len(order), window)
                 for i in sorted(order[w:w + window], key=lambda i: tokens[i].numel())]
    dataset = task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
    return [dataset.collater([dataset[i] for i in order[j:j + batch_size]]) for j in range(0, len(order), batch_size)]


def methods(k, compare_joins=False):
    """(name, batching, decoder options, pool arguments or None, encoder queue)."""
    ours = dict(beam_size=k, finalize="fairseq", keep_reference=False, runner="lean", output_layer="auto")
    topup = dict(order="fifo", eps=1 / 2)
    yield "mini", "mini", ours, None, 0
    yield "maxi", "maxi", ours, None, 0
    yield "full", "full", ours, None, 0
    yield "topup", "mini", ours, topup, 0
    yield "topup+enc", "mini", ours, topup, 2
    yield "topup+maxi", "maxi", ours, topup, 0
    yield "topup+maxi+enc", "maxi", ours, topup, 2
    if k > 1:
        yield "var-stream", "maxi", dict(ours, finalize="stay", pruning=Pruning(ap=1.5, mc=5)), \
            dict(order="shortest", eps=1 / 6), 0
    if compare_joins:
        apart = dict(topup, join_lengths=False)
        yield "topup-apart", "mini", ours, apart, 0
        yield "topup+maxi-apart", "maxi", ours, apart, 0


def run(options, pool_args, encoder_queue, models, task, batches, batch_size):
    opts = dict(options)
    if "pruning" in opts:
        opts["pruning"] = Pruning(ap=1.5, mc=5)  # fresh per decoder
    dec = BeamDecoder(models, task.target_dictionary, **opts)
    dec.stats.keep_steps = True
    start = time.perf_counter()
    with torch.no_grad():
        if pool_args is None:
            out = {}
            for s in batches:
                out.update(zip(s["id"].tolist(), dec.generate(models, s)))
        else:
            def encoded():
                for s in batches:
                    yield dec.open(s["net_input"], ids=s["id"])

            cohorts = read_ahead(encoded(), encoder_queue)
            try:
                out = dict(StreamPool(dec, batch_size, **pool_args).run(cohorts))
            finally:
                cohorts.close()
    wall = time.perf_counter() - start
    calls = [rows for _, rows, _ in dec.stats.steps]
    forward = sum(seconds for _, _, seconds in dec.stats.steps)  # inside the runner's calls, search excluded
    best = {sid: hyps[0]["tokens"].tolist() for sid, hyps in out.items()}
    return wall, best, calls, forward


def plot(per_call, title, path):
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq leaves the root logger at DEBUG

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, sizes in per_call.items():
        ax.plot(range(len(sizes)), sizes, lw=0.8, label=name)
    ax.set_xlabel("decoder call")
    ax.set_ylabel("sentences in the call")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--inputs", nargs="+", required=True)
    parser.add_argument("--limit", type=int, default=1000, help="first N sentences of each input (0: all)")
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--maxi-batch", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", help="directory for the sentences-per-call plots")
    parser.add_argument("--json")
    parser.add_argument("--compare-joins", action="store_true",
                        help="also run top-up with the cohorts of different refills kept apart")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models, task = load(args.model_dir, args.checkpoints)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "spm", "spm.model"))
    print("mini / maxi / top-up / encoder thread: {}, batch {}, maxi-batch {}, {} CPU thread(s), median of {} "
          "interleaved rounds, {}".format(args.model_dir, args.batch_size, args.maxi_batch, args.threads,
                                          args.repeats, time.strftime("%Y-%m-%d")))
    results = []
    for path in args.inputs:
        tokens = encode_lines(task, sp, path, args.limit)
        n = len(tokens)
        batchings = {b: batches_of(task, tokens, args.batch_size, b, args.maxi_batch) for b in ("mini", "maxi", "full")}
        for k in args.beams:
            chosen = list(methods(k, args.compare_joins))
            walls = {name: [] for name, *_ in chosen}
            forwards = {name: [] for name, *_ in chosen}
            best, calls = {}, {}
            for name, batching, options, pool_args, queue in chosen:  # warm-up
                run(options, pool_args, queue, models, task, batchings[batching][:1], args.batch_size)
            for _ in range(args.repeats):
                for name, batching, options, pool_args, queue in chosen:
                    wall, best[name], calls[name], forward = run(options, pool_args, queue, models, task,
                                                                 batchings[batching], args.batch_size)
                    walls[name].append(wall)
                    forwards[name].append(forward)
            print("  {} ({} sentences, {:.1f} tokens on average), k={}".format(
                os.path.basename(path), n, sum(t.numel() for t in tokens) / n, k))
            print("    {:<17}{:>9}{:>9}{:>8}{:>16}{:>15}{:>8}{:>11}{:>11}".format(
                "method", "wall s", "vs mini", "calls", "calls < 8 sent", "same as batch", "rows", "forward s",
                "us / row"))
            base = statistics.median(walls["mini"])
            for name, batching, *_ in chosen:
                wall = statistics.median(walls[name])
                per = [] if name == "var-stream" else [rows / k for rows in calls[name]]
                small = sum(1 for r in per if r < 8) / len(per) if per else float("nan")
                # Another search (var-stream) has other outputs: nothing to compare.
                same = None if name == "var-stream" else sum(best[name][s] == best[batching][s] for s in best[batching])
                # The runner's share (forward passes), apart from the search and the scheduling: with the
                # same rows, a difference here is a difference in what a row costs.
                forward, rows = statistics.median(forwards[name]), sum(calls[name])
                print("    {:<17}{:>9.2f}{:>8.2f}x{:>8}{:>16.0%}{:>15}{:>8}{:>11.2f}{:>11.1f}".format(
                    name, wall, base / wall, len(calls[name]), small, "-" if same is None else "{}/{}".format(same, n),
                    rows, forward, 1e6 * forward / rows))
                results.append({"input": path, "k": k, "method": name, "wall_s": wall, "walls_s": walls[name],
                                "calls": len(calls[name]), "small_call_share": small, "same_as_batch": same,
                                "sentences": n, "rows": rows, "forward_s": forward, "forwards_s": forwards[name]})
            if args.plot and k == max(args.beams):
                os.makedirs(args.plot, exist_ok=True)
                name = os.path.splitext(os.path.basename(path))[0]
                plot({m: [rows / k for rows in calls[m]] for m in ("mini", "maxi", "topup")},
                     "{}, k={}, batch {}: sentences per decoder call".format(name, k, args.batch_size),
                     os.path.join(args.plot, "topup_batch_size_{}_k{}.png".format(name, k)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "date": time.strftime("%Y-%m-%d"), "threads": args.threads,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
