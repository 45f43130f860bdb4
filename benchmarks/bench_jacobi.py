"""Jacobi decoding against greedy: latency (batch 1) and throughput (batches 16, 64), side by side.

One process, one model, the same fairseq batches for every method. Greedy is
our ``--search greedy`` on the same runner (lean) and output layer; each
Jacobi setting (pj; pgj b=3, 5; hgj b=3; each with PAD and n-gram drafts) is
checked token for token against it as it runs (a changed token is reported
and fails the run), and BLEU is computed for both.

Per setting: wall clock and its speedup over greedy, iteration speedup
(greedy's steps / the sentence's iterations, summed over sentences),
decoder-call speedup (greedy's calls per batch / Jacobi's), accepted tokens
per iteration, positions per iteration, the cost of an iteration against a
greedy step (iteration speedup / wall-clock speedup, all costs included: at
batch 1 the wall-clock speedup can only exceed the iteration speedup where
an iteration costs less than a greedy step), batches that ran greedy's own
step (a batch too full for windows to pay, JacobiDecoder._greedy_pays, or
where the calibration found that windows do not pay on this CPU), BLEU.
The CPU's model and SIMD level (``fairseq_stream/cpu_info.py``) and the load
average are recorded with the numbers: whether windows pay depends on the CPU.
``--pool-from train`` first fills every n-gram pool with the model's
training targets: a bound on what better n-grams could verify. "hgj b=auto ngram" is
the command line's default (b=3 for one sentence, 2 for several, windows only
at batch sizes where they pay on this CPU: ``--jacobi-calibrate auto``, its
table measured or read from the cache once before the rounds and printed);
"hgj b=auto ngram uncalibrated" the same windows without that choice; "hgj b=2
ngram always" is the previous default's window with every draft and no batch handed to greedy: what
the window call itself costs. "hgj b=1 ngram" drafts nothing: greedy's
steps through the Jacobi loop, what the loop costs against greedy's own. "c=k" settings draft trees of k candidates
(``--jacobi-candidates``; ``--candidates`` picks the k). Then the issue's
targets as ratios.

    python benchmarks/bench_jacobi.py /work/m30k/probe --refs /work/shared/data/multi30k/test_2016_flickr.en \\
        [--threads 1] [--batch-sizes 1 4 8 16 64] [--repeats 3] [--limit-latency 200] [--limit 1000] \\
        [--max-len-a 1.2 --max-len-b 10] [--device cpu|cuda] [--candidates 4 8] [--settings NAME ...] \\
        [--pool-from SUBSET] [--json FILE]

The length limit is the WMT examples' (``--max-len-a 1.2 --max-len-b 10``),
not fairseq's default 200 tokens: PJ refines every position up to the
maximum length in each iteration, and a 200-position window would measure
only that choice.

Without ``--refs`` (or without ``MODEL_DIR/spm/spm.model``, as for the toy
checkpoints of ``scripts/toy_cache.py``) BLEU is left out.
"""

import preamble  # first: the import paths (main sets the threads before it imports torch)

import argparse
import copy
import json
import os
import statistics
import sys
import time


# (variant, block, draft, call cost, candidates[, calibrate]): None is the device's default (JacobiDecoder);
# "always" a call cost so high that every row drafts everything and no batch runs greedy's step (the window
# alone). calibrate: "off" unless given (the settings as asked, as --jacobi-variant/--jacobi-block run).
ALWAYS = 1e9
SETTINGS = [("pj", 0, "pad", None, 1), ("pj", 0, "ngram", None, 1), ("pgj", 3, "pad", None, 1),
            ("pgj", 3, "ngram", None, 1), ("pgj", 5, "pad", None, 1), ("pgj", 5, "ngram", None, 1),
            ("hgj", 3, "pad", None, 1), ("hgj", 3, "ngram", None, 1), ("hgj", 2, "ngram", ALWAYS, 1),
            ("hgj", 2, "ngram", None, 1), ("hgj", "auto", "ngram", None, 1, "auto"),
            ("hgj", "auto", "ngram", None, 1, "off"), ("hgj", 1, "ngram", None, 1),
            ("hgj", 4, "ngram", None, 1), ("hgj", 5, "ngram", None, 1)]
# The command line's default: hgj, its block by how many sentences share a call (JacobiDecoder's AUTO_BLOCK),
# windows only where the calibration finds that they pay (--jacobi-calibrate auto).
DEFAULT = "hgj b=auto ngram"


def setting_name(variant, block, draft, call_cost, candidates=1, calibrate="off"):
    return "{}{} {}{}{}{}".format(variant, " b={}".format(block) if block else "", draft,
                                  " c={}".format(candidates) if candidates > 1 else "",
                                  " always" if call_cost == ALWAYS else "",
                                  " uncalibrated" if block == "auto" and calibrate == "off" else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--refs", help="reference text for BLEU (left out without it)")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--repeats", type=int, default=1,
                        help="interleaved rounds (greedy, then every setting); times are medians")
    parser.add_argument("--limit-latency", type=int, default=200, help="sentences decoded at batch 1")
    parser.add_argument("--limit", type=int, default=1000, help="sentences decoded at larger batches")
    parser.add_argument("--max-len-a", type=float, default=1.2)
    parser.add_argument("--max-len-b", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--candidates", type=int, nargs="*", default=[4],
                        help="also run hgj b=2 and b=3 ngram with trees of this many candidates (and b=3, b=5 always)")
    parser.add_argument("--settings", nargs="+", help="run only these settings (names as printed), and greedy")
    parser.add_argument("--pool-from", metavar="SUBSET",
                        help="first fill every n-gram pool with the target side of this subset of the model's data "
                             "(e.g. train): how far better n-grams could raise the iteration speedup; the pool's "
                             "lookups are not built for a corpus, so wall clock is not the point there")
    parser.add_argument("--json")
    args = parser.parse_args()
    # Trees of candidates: at the device's call cost, and "always" (every candidate drafted, as a
    # device whose extra positions are free would: the bound on the iteration speedup).
    settings = SETTINGS + [("hgj", b, "ngram", cost, k) for k in args.candidates if k > 1
                           for b, cost in ((2, None), (3, None), (3, ALWAYS), (5, ALWAYS))]
    if any(k > 1 for k in args.candidates):
        settings.append(("hgj", 5, "ngram", ALWAYS, 1))  # the same block as one chain
    if args.settings:
        settings = [s for s in settings if setting_name(*s) in args.settings]
        unknown = set(args.settings) - {setting_name(*s) for s in settings}
        if unknown:
            parser.error("unknown settings: {}".format(", ".join(sorted(unknown))))
    preamble.set_threads(args.threads)

    import sentencepiece as spm
    import torch

    torch.set_num_threads(args.threads)
    from bench_search import bleu as corpus_bleu
    from bench_search import load, make_batches, synchronize
    from fairseq_stream import cpu_info
    from fairseq_stream.decoder import BeamDecoder
    from fairseq_stream.jacobi.decoder import JacobiDecoder

    models, task = load(args.model_dir, args.checkpoints, args.device)
    spm_model = os.path.join(args.model_dir, "spm", "spm.model")
    sp, refs = None, None
    if args.refs and os.path.exists(spm_model):
        sp = spm.SentencePieceProcessor(model_file=spm_model)
        with open(args.refs, encoding="utf-8") as f:
            refs = f.read().splitlines()

    def bleu(out):
        return corpus_bleu(out, task, sp, refs) if sp is not None else float("nan")

    def greedy():
        dec = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", output_layer="auto",
                          keep_reference=False, max_len_a=args.max_len_a, max_len_b=args.max_len_b)
        return dec.cuda() if args.device == "cuda" else dec

    def run(dec, batches):
        out = {}
        synchronize(args.device)
        start = time.perf_counter()
        with torch.no_grad():
            for s in batches:
                for sid, hyps in zip(s["id"].tolist(), dec.generate(models, s)):
                    out[sid] = hyps[0]["tokens"]
        synchronize(args.device)
        return out, time.perf_counter() - start

    seeded = None
    if args.pool_from:
        task.load_dataset(args.pool_from)
        targets = task.dataset(args.pool_from).tgt
        eos = task.target_dictionary.eos()
        seeds = [[eos] + targets[i].tolist() for i in range(len(targets))]

        def seeded(dec):
            if dec.pool is not None:
                # A pool's shape is its draft span and candidate count: filled once for each.
                key = (dec.pool.span, dec.pool.top_size)
                if key not in seed_pools:
                    for tokens in seeds:
                        dec.pool.add_output(tokens)
                    seed_pools[key] = dec.pool
                dec.pool = copy.deepcopy(seed_pools[key])
            return dec

        seed_pools = {}

    device = torch.cuda.get_device_name() if args.device == "cuda" else cpu_info.cpu_model()
    simd = cpu_info.simd_level()
    load_before = os.getloadavg()
    print("device: {}, SIMD: {}, threads: {}, {} {}, max length {} x source + {}, load average {:.2f}".format(
        device, simd, args.threads, args.model_dir, args.checkpoints, args.max_len_a, args.max_len_b,
        load_before[0]))
    # The default's calibration, once (measured, or read from the cache as a second run would): every
    # calibrated setting then reuses its table.
    calibrating = JacobiDecoder(greedy(), "hgj", None, "ngram", calibrate="auto")
    calibrating._chooser(torch.device(args.device))
    costs = calibrating.costs
    if costs is not None:
        print("calibration ({}, {}): {}".format(costs.source, costs.path, costs.describe()))
    if args.pool_from:
        print("n-gram pools first filled with the {} targets of subset '{}'".format(len(seeds), args.pool_from))
    rows, changed = [], 0
    for batch_size in args.batch_sizes:
        limit = args.limit_latency if batch_size == 1 else args.limit
        batches = make_batches(task, args.subset, batch_size, limit, args.device)
        run(greedy(), batches[:2])  # warm-up
        walls = {"greedy": []}
        outputs, stats = {}, {}
        # Interleaved rounds: this VM's speed drifts by several percent between runs of the same code.
        for _ in range(args.repeats):
            ref, wall = run(greedy(), batches)
            walls["greedy"].append(wall)
            for setting in settings:
                variant, block, draft, call_cost, candidates = setting[:5]
                calibrate = setting[5] if len(setting) > 5 else "off"
                name = setting_name(*setting)
                block = None if block == "auto" else block or 1
                dec = JacobiDecoder(greedy(), variant, block, draft, call_cost=call_cost, candidates=candidates,
                                    calibrate=calibrate, costs=costs)
                if seeded is not None:
                    seeded(dec)
                outputs[name], wall = run(dec, batches)
                walls.setdefault(name, []).append(wall)
                stats[name] = dec.stats.summary()
        ref_wall = statistics.median(walls["greedy"])
        ref_bleu = bleu(ref)
        print("\nbatch {} ({} sentences): greedy {:.2f} s, {:.1f} ms/sentence, BLEU {:.2f}".format(
            batch_size, len(ref), ref_wall, 1000 * ref_wall / len(ref), ref_bleu))
        print("{:<28} {:>8} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8} {:>7} {:>8}".format(
            "setting", "wall s", "speedup", "iter spd", "call spd", "acc/iter", "pos/iter", "cost/iter", "greedy b",
            "BLEU", "changed"))
        for setting in settings:
            name = setting_name(*setting)
            out, wall, s = outputs[name], statistics.median(walls[name]), stats[name]
            bad = sum(not torch.equal(ref[i], out[i]) for i in ref)
            changed += bad
            row = dict(batch=batch_size, setting=name, wall_s=wall, speedup=ref_wall / wall,
                       walls=walls[name], greedy_walls=walls["greedy"],
                       iteration_speedup=s["iteration_speedup"], call_speedup=s["call_speedup"],
                       accepted_per_iteration=s["accepted_per_iteration"], greedy_batches=s["greedy_batches"],
                       calibrated_greedy_batches=s["calibrated_greedy_batches"],
                       batches=len(batches), bleu=bleu(out),
                       greedy_bleu=ref_bleu, greedy_wall_s=ref_wall, changed=bad, sentences=len(ref),
                       accepted_histogram=s["accepted_histogram"],
                       positions_per_iteration=s["expansions"] / max(1, s["iterations"]),
                       tree_windows=s["tree_windows"])
            # What an iteration costs against a greedy step, everything included (the encoder, the
            # per-sentence work): speedup = iteration speedup / this.
            row["iteration_cost"] = row["iteration_speedup"] / row["speedup"]
            rows.append(row)
            print("{:<28} {:>8.2f} {:>7.2f}x {:>9.2f}x {:>9.2f}x {:>9.2f} {:>9.2f} {:>8.2f}x {:>8} {:>7.2f} {:>8}".format(
                name, wall, row["speedup"], row["iteration_speedup"], row["call_speedup"],
                row["accepted_per_iteration"], row["positions_per_iteration"], row["iteration_cost"],
                "{}/{}".format(s["greedy_batches"], len(batches)), row["bleu"], bad))
    print("\nload average {:.2f} before, {:.2f} after".format(load_before[0], os.getloadavg()[0]))
    print("\ntargets:")
    latency = [r for r in rows if r["batch"] == 1]
    if latency:
        best = max(latency, key=lambda r: r["speedup"])
        print("  batch 1, best wall-clock speedup >= 1.38: {} {:.2f}x".format(best["setting"], best["speedup"]))
        ngram = max((r for r in latency if " ngram" in r["setting"]), key=lambda r: r["iteration_speedup"])
        print("  iteration speedup with n-gram drafts >= 1.5: {} {:.2f}x".format(ngram["setting"],
                                                                               ngram["iteration_speedup"]))
    for r in rows:
        if r["setting"] == DEFAULT:
            print("  batch {}, default ({}, calibrated) >= 1.0x greedy on {} ({}): {:.2f}x".format(
                r["batch"], DEFAULT, device, simd, r["speedup"]))
    for batch in sorted({r["batch"] for r in rows}):
        best = max((r for r in rows if r["batch"] == batch), key=lambda r: r["speedup"])
        print("  batch {}, best setting on {} ({}): {} {:.2f}x".format(batch, device, simd, best["setting"],
                                                                    best["speedup"]))
    print("  changed tokens: {}".format(changed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, cpu=cpu_info.cpu_model(), simd=simd, threads=args.threads,
                           load_average=[load_before[0], os.getloadavg()[0]], argv=sys.argv[1:],
                           calibration=costs.to_json() if costs is not None else None, rows=rows), f, indent=1)
    if changed:
        sys.exit("a Jacobi setting changed greedy's output")


if __name__ == "__main__":
    main()
