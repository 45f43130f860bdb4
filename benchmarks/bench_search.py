"""Search benchmark: BLEU, wall clock and search counters, side by side in one process.

Reproduces the layout of Yang et al. (2020), Tables 1 and 5, for greedy,
fairseq's beam search and our fixed / var searches, on one model and one input
set. Every method decodes the same batches; wall clock is the median of
``--repeats`` full passes; BLEU is sacreBLEU on detokenized output.

    python benchmarks/bench_search.py MODEL_DIR [--beams 5 50] [--repeats 3]

MODEL_DIR is what ``scripts/train_multi30k.sh`` writes (spm/, data-bin/,
transformer/); ``--refs`` is the raw reference file (e.g.
``../shared/data/multi30k/test_2016_flickr.en``).
"""

import preamble  # noqa: F401  (first: the import paths)

import argparse
import contextlib
import json
import os
import statistics
import time

import sacrebleu
import sentencepiece as spm
import torch

import fairseq_stream  # noqa: F401  (safe checkpoint loading)
from fairseq import checkpoint_utils, utils
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.search.pruning import Pruning
from fairseq_stream.stats import DecodeStats


class RowCounter:
    """Counts decoder calls and rows for fairseq's own generator (same definitions as ours)."""

    def __init__(self):
        self.stats = DecodeStats()
        self._orig = EnsembleModel.forward_decoder

    def __enter__(self):
        counter = self

        def forward_decoder(model, tokens, *args, **kwargs):
            counter.stats.add_step(tokens.size(1), tokens.size(0), 0.0)
            return counter._orig(model, tokens, *args, **kwargs)

        EnsembleModel.forward_decoder = forward_decoder
        return self

    def __exit__(self, *exc):
        EnsembleModel.forward_decoder = self._orig


def load(model_dir, checkpoints, device="cpu"):
    paths = [os.path.join(model_dir, c) for c in checkpoints.split(":")]
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        paths, arg_overrides={"data": os.path.join(model_dir, "data-bin")}
    )
    for m in models:
        m.eval()
        m.to(device)
    return models, task


def synchronize(device):
    """Wait for the device: CUDA calls return before the work is done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def make_batches(task, subset, batch_size, limit, device="cpu"):
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    itr = task.get_batch_iterator(
        dataset=dataset, max_sentences=batch_size, required_batch_size_multiple=1
    ).next_epoch_itr(shuffle=False)
    batches = list(itr)
    if limit:
        # Keep fairseq's length-sorted order, regrouped into full batches.
        ids = [i for b in batches for i in b["id"].tolist() if i < limit]
        batches = [
            dataset.collater([dataset[i] for i in ids[j : j + batch_size]])
            for j in range(0, len(ids), batch_size)
        ]
    # Moved once, before any timing: fairseq-generate moves each batch too,
    # but that copy is the same for every method.
    return [utils.apply_to_sample(lambda t: t.to(device), b) for b in batches]


def methods(models, task, beam):
    d = task.target_dictionary
    yield "fairseq beam", lambda: SequenceGenerator(models, d, beam_size=beam)
    yield "fixed (fairseq)", lambda: BeamDecoder(models, d, beam_size=beam, finalize="fairseq")
    yield "fixed (stay)", lambda: BeamDecoder(models, d, beam_size=beam, finalize="stay")
    yield "var-batch (d=1.5, M=5)", lambda: BeamDecoder(
        models, d, beam_size=beam, finalize="stay", pruning=Pruning(ap=1.5, mc=5)
    )


def run(make, models, batches, counter_needed):
    generator = make()
    outputs = {}
    counter = RowCounter() if counter_needed else None
    start = time.perf_counter()
    with torch.no_grad(), (counter or contextlib.nullcontext()):
        for sample in batches:
            for sid, hyps in zip(sample["id"].tolist(), generator.generate(models, sample)):
                outputs[sid] = hyps[0]["tokens"]
    wall = time.perf_counter() - start
    stats = counter.stats if counter else generator.stats
    return wall, outputs, stats


def bleu(outputs, task, sp, refs):
    d = task.target_dictionary
    ids = sorted(outputs)
    hyps = [sp.decode(d.string(outputs[i].cpu()).split()) for i in ids]
    return sacrebleu.corpus_bleu(hyps, [[refs[i] for i in ids]]).score


def add_input_arguments(parser):
    """The model, input and beam arguments every benchmark here takes."""
    parser.add_argument("model_dir", help="what scripts/train_multi30k.sh writes (spm/, data-bin/, transformer/)")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--refs", required=True, help="raw reference text, one line per sentence")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--beams", type=int, nargs="+", default=[5, 50])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--limit", type=int, default=0, help="only sentences with id < LIMIT")
    parser.add_argument("--json", help="write all results here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    models, task = load(args.model_dir, args.checkpoints)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "spm", "spm.model"))
    refs = open(args.refs, encoding="utf-8").read().splitlines()
    batches = make_batches(task, args.subset, args.batch_size, args.limit)
    n = sum(len(b["id"]) for b in batches)
    print("{} sentences, batch size {}, {} thread(s), median of {} runs".format(
        n, args.batch_size, args.threads, args.repeats))

    rows = []

    def measure(name, beam, make, fairseq_own):
        walls, outputs, stats = [], None, None
        for _ in range(args.repeats):
            wall, outputs, stats = run(make, models, batches, fairseq_own)
            walls.append(wall)
        s = stats.summary()
        row = {
            "method": name, "k": beam, "bleu": round(bleu(outputs, task, sp, refs), 2),
            "wall_s": round(statistics.median(walls), 2), "walls": [round(w, 2) for w in walls],
            "timesteps": s["timesteps"], "expansions": s["expansions"],
            "expansions_per_step": round(s["expansions_per_step"], 1),
        }
        rows.append(row)
        print("| {method} | {k} | {bleu:.2f} | {wall_s:.2f} | {timesteps} | {expansions} | "
              "{expansions_per_step} |".format(**row), flush=True)
        return outputs

    print("| method | k | BLEU | wall clock (s) | timesteps | expansions | exp./step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    d = task.target_dictionary
    measure("greedy", 1, lambda: BeamDecoder(models, d, beam_size=1), False)
    for beam in args.beams:
        for name, make in methods(models, task, beam):
            measure(name, beam, make, name == "fairseq beam")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sentences": n, "batch_size": args.batch_size, "threads": args.threads,
                       "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
