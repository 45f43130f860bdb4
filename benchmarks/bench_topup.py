"""Top-up batching (``--generator topup``) against batch decoding, on short and long inputs, side by side.

One process, one model (the Multi30k transformer: spm/, data-bin/, transformer/),
one CPU thread. Each input (raw source text, one sentence a line, e.g. the
Multi30k test set: short sentences; newstest2017 De-En: long ones) is encoded
with the model's sentencepiece and batched as fairseq-generate batches it
(sorted by length over the whole input: an unbounded maxi-batch), ``--batch-size``
sentences a batch. Methods, at each beam in ``--beams``:

* ``fairseq``: fairseq's SequenceGenerator (beam k; beam 1 for greedy);
* ``batch``: our loop on fairseq's batches (greedy for k = 1, fixed
  ``--finalize fairseq`` otherwise; runner and output layer as ``auto`` picks
  under ``--generator batch``: for fixed k, fairseq's runner and torch's layer);
* ``batch-lean`` (k > 1): the same on the lean runner and fused layer, which
  ``auto`` picks under any other scheduler;
* ``topup``: that decoder through the pool in FIFO order refilled at 1/2
  (``--generator topup``), pool = batch size;
* ``var-stream`` (k > 1): VAR-STREAM (δ=1.5, M=5, ε=1/6), for reference.

Reported: wall clock (median of ``--repeats`` interleaved rounds), decoder
calls, the share of calls that ran fewer than 8 sentences (the paper's
Figure 8 measure; rows / k, as every layout here but var-stream's is dense), and whether every sentence's
best hypothesis equals the ``batch`` run's.

This is the first part of the top-up issue: mini-batching (input order, no
sorting) and the encoder thread are not built yet, so their columns are absent.

    python benchmarks/bench_topup.py /work/m30k/probe \\
        --inputs /work/shared/data/multi30k/test_2016_flickr.de /work/shared/data/wmt/de-en/newstest2017.de \\
        [--limit 1000] [--beams 1 5] [--repeats 3] [--json FILE]
"""

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_search import load  # noqa: E402
from bench_stream import decode_stream  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.schedule.pool import StreamPool  # noqa: E402
from fairseq_stream.search.pruning import Pruning  # noqa: E402


def batches_of(task, sp, path, limit, batch_size):
    """fairseq-generate's batches of a raw text file: encoded, length-sorted, ``batch_size`` sentences each."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f][: limit or None]
    d = task.source_dictionary
    tokens = [d.encode_line(" ".join(sp.encode(line, out_type=str)), add_if_not_exist=False).long() for line in lines]
    max_len = min(task.max_positions()) if isinstance(task.max_positions(), tuple) else task.max_positions()
    tokens = [t[: max_len - 1].clone() if t.numel() > max_len else t for t in tokens]
    for t in tokens:
        t[-1] = d.eos()
    dataset = task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
    itr = task.get_batch_iterator(dataset=dataset, max_sentences=batch_size,
                                  required_batch_size_multiple=1).next_epoch_itr(shuffle=False)
    return list(itr), len(lines)


def methods(k):
    greedy = k == 1
    ours = dict(beam_size=k, finalize="fairseq", keep_reference=False if greedy else None, runner="auto",
                output_layer="auto")
    # As the command line builds them: --generator batch keeps fixed k's
    # fairseq references, a scheduler takes the lean runner and fused layer.
    yield "fairseq", lambda m, d: SequenceGenerator(m, d, beam_size=k), None
    yield "batch", lambda m, d: BeamDecoder(m, d, **ours), None
    if not greedy:
        yield "batch-lean", lambda m, d: BeamDecoder(m, d, **dict(ours, keep_reference=False)), None
    yield "topup", lambda m, d: BeamDecoder(m, d, **dict(ours, keep_reference=False)), dict(order="fifo", eps=1 / 2)
    if not greedy:
        yield "var-stream", lambda m, d: BeamDecoder(m, d, beam_size=k, finalize="stay",
                                                     pruning=Pruning(ap=1.5, mc=5), runner="auto",
                                                     output_layer="auto"), dict(order="shortest", eps=1 / 6)


def run(make, pool_args, models, task, batches, batch_size, k):
    gen = make(models, task.target_dictionary)
    calls = []
    if isinstance(gen, BeamDecoder):
        gen.stats.keep_steps = True
    start = time.perf_counter()
    with torch.no_grad():
        if pool_args is None:
            out = {}
            for s in batches:
                out.update(zip(s["id"].tolist(), gen.generate(models, s)))
        else:
            pool = StreamPool(gen, batch_size, **pool_args)
            out = dict(pool.run(gen.open(s["net_input"], ids=s["id"]) for s in batches))
    wall = time.perf_counter() - start
    if isinstance(gen, BeamDecoder):
        calls = [rows for _, rows, _ in gen.stats.steps]
    best = {sid: hyps[0]["tokens"].tolist() for sid, hyps in out.items()}
    return wall, best, calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--inputs", nargs="+", required=True)
    parser.add_argument("--limit", type=int, default=1000, help="first N sentences of each input (0: all)")
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models, task = load(args.model_dir, args.checkpoints)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "spm", "spm.model"))
    print("top-up vs batch: {}, batch {}, one CPU thread, median of {} interleaved rounds, {}".format(
        args.model_dir, args.batch_size, args.repeats, time.strftime("%Y-%m-%d")))
    results = []
    for path in args.inputs:
        batches, n = batches_of(task, sp, path, args.limit, args.batch_size)
        for k in args.beams:
            chosen = list(methods(k))
            walls = {name: [] for name, _, _ in chosen}
            best, calls = {}, {}
            for name, make, pool_args in chosen:  # warm-up
                run(make, pool_args, models, task, batches[:1], args.batch_size, k)
            for _ in range(args.repeats):
                for name, make, pool_args in chosen:
                    wall, best[name], calls[name] = run(make, pool_args, models, task, batches, args.batch_size, k)
                    walls[name].append(wall)
            print("  {} ({} sentences), k={}".format(os.path.basename(path), n, k))
            print("    {:<11}{:>9}{:>10}{:>8}{:>16}{:>16}".format("method", "wall s", "vs batch", "calls",
                                                                  "calls < 8 sent", "same as batch"))
            base = statistics.median(walls["batch"])
            for name, _, _ in chosen:
                wall = statistics.median(walls[name])
                # Sentences per call: rows / k in the dense layouts; var-stream's
                # rows are live hypotheses, not sentences (not reported).
                per = [] if name == "var-stream" else [rows / k for rows in calls[name]]
                small = sum(1 for r in per if r < 8) / len(per) if per else float("nan")
                same = sum(best[name][s] == best["batch"][s] for s in best["batch"])
                print("    {:<11}{:>9.2f}{:>9.2f}x{:>8}{:>16.0%}{:>12}/{}".format(
                    name, wall, base / wall, len(calls[name]) or "-", small, same, n))
                results.append({"input": path, "k": k, "method": name, "wall_s": wall, "walls_s": walls[name],
                                "calls": len(calls[name]), "small_call_share": small, "same_as_batch": same,
                                "sentences": n})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
