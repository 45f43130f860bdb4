"""Fused output layer, end to end: decoding with ``output_layer="fused"`` against ``"torch"``.

The decode half of the fused-output-layer issue (the op half is
``bench_output_layer.py``). One process, one model, the same fairseq batches
(``--batch-size``, length-sorted as fairseq-generate makes them) for every
method, one CPU thread (or ``--device cuda``); both output layers run on the
same runner (``--runner``, default lean), so the output layer is the only
difference:

* greedy (k = 1);
* fixed k = 5 (``--finalize fairseq``: the dense layout, all S x k rows);
* var-stream k = 50 (``stay``, delta = 1.5, M = 5, on the stream pool: eps =
  1/6 counting sentences, shortest first, pool = batch size, as
  ``bench_stream.py``).

Per method and output layer: wall clock (median of ``--repeats`` interleaved
rounds), decoder calls and rows, BLEU (sacreBLEU on detokenized output). Per
search, how many sentences' best hypotheses are identical token for token
between the two layers, and the largest difference of their scores. Then the
issue's targets as ratios (torch wall / fused wall): never below 1.0, and
>= 1.1 for greedy on the CPU.

    python benchmarks/bench_fused_decode.py /work/m30k/probe \\
        --refs /work/shared/data/multi30k/test_2016_flickr.en \\
        [--repeats 3] [--limit N] [--runner lean|fairseq] [--device cpu|cuda] [--json FILE]
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

from bench_output_layer import cpu_name  # noqa: E402
from bench_search import bleu, load, make_batches, synchronize  # noqa: E402
from bench_stream import decode_batch, decode_stream  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.search.pruning import Pruning  # noqa: E402

LAYERS = ("torch", "fused")


def searches(wide_k):
    """(name, BeamDecoder options, streamed?) of the three searches the issue names."""
    return [
        ("greedy", dict(beam_size=1, finalize="fairseq", keep_reference=False), False),
        ("fixed k=5", dict(beam_size=5, finalize="fairseq"), False),
        ("var-stream k={}".format(wide_k),
         dict(beam_size=wide_k, finalize="stay", pruning=None), True),
    ]


def decoder_for(models, task, options, layer, runner, device):
    opts = dict(options)
    if "pruning" in opts:
        opts["pruning"] = Pruning(ap=1.5, mc=5)  # fresh per decoder
    dec = BeamDecoder(models, task.target_dictionary, runner=runner, output_layer=layer, **opts)
    if device == "cuda":
        dec.cuda()
    want = "torch" if layer == "torch" else device
    if dec.output_backend != want:
        raise SystemExit("output layer {}: the decoder chose {} (is the kernel built?)".format(layer,
                                                                                              dec.output_backend))
    return dec


def one_round(models, task, batches, options, streamed, layer, runner, device, pool):
    dec = decoder_for(models, task, options, layer, runner, device)
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        if streamed:
            out = decode_stream(dec, batches, pool, eps=1 / 6, unit="sentences")
        else:
            out = decode_batch(dec, models, batches)
    synchronize(device)
    wall = time.perf_counter() - start
    best = {sid: (hyps[0]["tokens"].cpu(), float(hyps[0]["score"])) for sid, hyps in out.items()}
    return wall, best, dec.stats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="what scripts/train_multi30k.sh writes (spm/, data-bin/, transformer/)")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--refs", required=True, help="raw reference text, one line per sentence")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--wide-k", type=int, default=50, help="k of var-stream")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=0, help="only sentences with id < LIMIT")
    parser.add_argument("--runner", default="lean", choices=["lean", "fairseq"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", help="write all results here")
    args = parser.parse_args(argv)

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    models, task = load(args.model_dir, args.checkpoints, args.device)
    batches = make_batches(task, args.subset, args.batch_size, args.limit, args.device)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "spm", "spm.model"))
    with open(args.refs, encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    n_sent = sum(b["id"].numel() for b in batches)
    machine = cpu_name() if args.device == "cpu" else torch.cuda.get_device_name()
    print("fused output layer, end to end: {} sentences of {}, batch {}, runner {}, {} ({}, {} thread{}), "
          "median of {} interleaved rounds".format(
              n_sent, args.subset, args.batch_size, args.runner, args.device, machine, torch.get_num_threads(),
              "" if torch.get_num_threads() == 1 else "s", args.repeats))

    results = []
    for name, options, streamed in searches(args.wide_k):
        walls = {layer: [] for layer in LAYERS}
        best, stats = {}, {}
        # Warm-up (first calls allocate), then rounds alternating the layers.
        for layer in LAYERS:
            one_round(models, task, batches[:1], options, streamed, layer, args.runner, args.device,
                      args.batch_size)
        for _ in range(args.repeats):
            for layer in LAYERS:
                wall, best[layer], stats[layer] = one_round(models, task, batches, options, streamed, layer,
                                                            args.runner, args.device, args.batch_size)
                walls[layer].append(wall)
        same = sum(torch.equal(best["torch"][s][0], best["fused"][s][0]) for s in best["torch"])
        score_diff = max(abs(best["torch"][s][1] - best["fused"][s][1]) for s in best["torch"]
                         if torch.equal(best["torch"][s][0], best["fused"][s][0]))
        row = {"search": name, "identical": same, "sentences": len(best["torch"]), "max_score_diff": score_diff}
        for layer in LAYERS:
            row[layer] = {
                "wall_s": statistics.median(walls[layer]),
                "walls_s": walls[layer],
                "bleu": bleu({s: t for s, (t, _) in best[layer].items()}, task, sp, refs),
                "calls": stats[layer].timesteps,
                "rows": stats[layer].expansions,
            }
        row["speedup"] = row["torch"]["wall_s"] / row["fused"]["wall_s"]
        results.append(row)

    print("  {:<16}{:>10}{:>10}{:>9}{:>8}{:>8}{:>9}{:>8}{:>12}{:>12}".format(
        "search", "torch s", "fused s", "speedup", "BLEU t", "BLEU f", "calls", "rows/c", "identical",
        "max |d s|"))
    for r in results:
        t, f = r["torch"], r["fused"]
        print("  {:<16}{:>10.2f}{:>10.2f}{:>8.2f}x{:>8.2f}{:>8.2f}{:>9}{:>8.1f}{:>7}/{:<4}{:>12.1e}".format(
            r["search"], t["wall_s"], f["wall_s"], r["speedup"], t["bleu"], f["bleu"], f["calls"],
            f["rows"] / max(f["calls"], 1), r["identical"], r["sentences"], r["max_score_diff"]))
    print("targets (torch wall / fused wall; identical hypotheses):")
    for r in results:
        need = 1.1 if r["search"] == "greedy" and args.device == "cpu" else 1.0
        verdict = "ok" if r["speedup"] >= need else "MISS"
        print("  {:<16} speedup {:.2f}x >= {:.1f}x: {:<5} identical {}/{}: {}".format(
            r["search"], r["speedup"], need, verdict, r["identical"], r["sentences"],
            "ok" if r["identical"] == r["sentences"] else "MISS"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "device": args.device, "machine": machine,
                       "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
