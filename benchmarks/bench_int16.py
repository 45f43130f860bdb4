"""int16 CPU decoding of fairseq LSTM models (Devlin 2017): words/s and BLEU, one CPU thread, beam 5.

One process, one model, the same sentences for every method, in two settings:
one sentence at a time (batch 1) and batched (``--batch-size``, default 64,
fairseq's length-sorted batches). Methods, in the layout of Devlin's Table 1
(each of ours adds one trick to the row above it):

* ``fairseq fp32``: fairseq's ``SequenceGenerator`` (beam 5), the baseline;
* ``torch int8 (dynamic)``: the peer a user would try first, fairseq's
  generator on ``torch.ao.quantization.quantize_dynamic`` copies of the
  models (``nn.LSTM``, ``nn.LSTMCell``, ``nn.Linear``; qint8, fbgemm);
* ``ours, fairseq runner``: our fixed beam (fairseq's finalization) on
  fairseq's own decoder calls, with the fused output layer;
* ``rnn runner, no tricks``: our LSTM step, float32, every trick off;
* ``+ int16 products``, ``+ embedding table``, ``+ attention table``,
  ``+ merged states``, ``+ fused step`` (the step in one compiled call with
  vectorized sigmoid and tanh, section 4.4): cumulative; the last row is
  ``--rnn-int16``;
* ``rnn runner fp32`` (every exact trick, no int16: ``--runner rnn``).

Words/s counts the words of the detokenized best hypotheses per second of
decoding (encoder included; loading and batching excluded). BLEU is
sacreBLEU on the detokenized output; "same as fp32" is the share of sentences
whose best hypothesis has fairseq fp32's tokens. Rounds are interleaved
(``--repeats``); the median wall clock is reported.

    python benchmarks/bench_int16.py /work/m30k/probe \\
        --refs /work/shared/data/multi30k/test_2016_flickr.en [--limit N] [--repeats 1] [--json FILE]
"""

import preamble  # first: the import paths, then the threads before torch starts its pools

preamble.set_threads(1)

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import sacrebleu  # noqa: E402
import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402

from bench_output_layer import cpu_name  # noqa: E402
from bench_search import load, make_batches  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.ops import int16_linear  # noqa: E402
from fairseq_stream.runners.rnn import RnnOptions, unsupported_reason  # noqa: E402

BASELINE, PEER, ALL_TRICKS = "fairseq fp32", "torch int8 (dynamic)", "+ fused step (--rnn-int16)"


def quantized_copies(models):
    """torch's dynamic int8 quantization of every LSTM, LSTMCell and Linear module (fbgemm)."""
    torch.backends.quantized.engine = "fbgemm"
    return [torch.ao.quantization.quantize_dynamic(
        copy.deepcopy(m), {torch.nn.LSTM, torch.nn.LSTMCell, torch.nn.Linear}, dtype=torch.qint8).eval()
        for m in models]


def methods(models, int8_models, d, beam):
    """(name, models to decode with, a factory of the generator) in table order."""

    def ours(runner, **options):
        return lambda: BeamDecoder(models, d, beam_size=beam, finalize="fairseq", runner=runner,
                                   keep_reference=False, output_layer="auto", rnn_options=RnnOptions(**options))

    none = dict(embed_table=False, attention_table=False, merge_states=False)
    yield BASELINE, models, lambda: SequenceGenerator(models, d, beam_size=beam)
    yield PEER, int8_models, lambda: SequenceGenerator(int8_models, d, beam_size=beam)
    yield "ours, fairseq runner", models, ours("fairseq")
    yield "rnn runner, no tricks", models, ours("rnn", **none)
    yield "+ int16 products", models, ours("rnn", **dict(none, int16=True, fused_step=False))
    yield "+ embedding table", models, ours("rnn", int16=True, attention_table=False, merge_states=False,
                                            fused_step=False)
    yield "+ attention table", models, ours("rnn", int16=True, merge_states=False, fused_step=False)
    yield "+ merged states", models, ours("rnn", int16=True, fused_step=False)
    yield ALL_TRICKS, models, ours("rnn", int16=True)
    yield "rnn runner fp32 (exact tricks)", models, ours("rnn")


def one_run(make, models, batches):
    generator = make()
    out = {}
    start = time.perf_counter()
    with torch.no_grad():
        for sample in batches:
            for sid, hyps in zip(sample["id"].tolist(), generator.generate(models, sample)):
                out[sid] = hyps[0]["tokens"]
    return time.perf_counter() - start, out


def detokenized(outputs, d, sp):
    return {i: sp.decode(d.string(t).split()) for i, t in outputs.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="what scripts/train_multi30k.sh --lstm writes (spm/, data-bin/, lstm/)")
    parser.add_argument("--checkpoints", default="lstm/checkpoint_best.pt")
    parser.add_argument("--refs", required=True, help="raw reference text, one line per sentence")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--limit", type=int, default=0, help="sentences with id < N only (0: all)")
    parser.add_argument("--limit-single", type=int, default=0,
                        help="one at a time: sentences with id < N only (default: --limit)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5, help="untimed batches decoded by each method first")
    parser.add_argument("--only", nargs="*", help="run only these methods (names as printed)")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    models, task = load(args.model_dir, args.checkpoints)
    reasons = [r for r in map(unsupported_reason, models) if r]
    if reasons:
        sys.exit("bench_int16: {}".format(reasons[0]))
    int8_models = quantized_copies(models)
    d = task.target_dictionary
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "spm", "spm.model"))
    refs = [line.rstrip("\n") for line in open(args.refs, encoding="utf-8")]
    settings = {
        "one at a time": make_batches(task, args.subset, 1, args.limit_single or args.limit),
        "batched ({})".format(args.batch_size): make_batches(task, args.subset, args.batch_size, args.limit),
    }
    table = list(methods(models, int8_models, d, args.beam))
    if args.only:
        table = [m for m in table if m[0] in args.only or m[0] in (BASELINE,)]
    print("machine: {}; torch {}; int16 kernel: {}; one thread; beam {}".format(
        cpu_name(), torch.__version__, int16_linear.kernel(), args.beam))
    print("model: {} ({} parameters)".format(args.checkpoints, sum(p.numel() for p in models[0].parameters())))
    results = {}
    for setting, batches in settings.items():
        sentences = sum(b["id"].numel() for b in batches)
        walls = {name: [] for name, _, _ in table}
        outputs = {}
        # Untimed first calls: otherwise the first method timed (fairseq fp32) pays the process's
        # one-time costs (lazy initialization, allocator and caches), which flatters every ratio.
        for name, members, make in table:
            one_run(make, members, batches[: args.warmup])
        for _ in range(args.repeats):
            for name, members, make in table:
                wall, out = one_run(make, members, batches)
                walls[name].append(wall)
                outputs[name] = out
        base = outputs[BASELINE]
        rows = {}
        for name, _, _ in table:
            text = detokenized(outputs[name], d, sp)
            ids = sorted(text)
            words = sum(len(text[i].split()) for i in ids)
            wall = statistics.median(walls[name])
            rows[name] = dict(
                wall_s=wall, walls=walls[name], words=words, words_per_s=words / wall,
                bleu=sacrebleu.corpus_bleu([text[i] for i in ids], [[refs[i] for i in ids]]).score,
                same_as_fp32=sum(torch.equal(outputs[name][i], base[i]) for i in ids) / len(ids),
            )
        results[setting] = dict(sentences=sentences, rows=rows)
        print("\n{}: {} sentences".format(setting, sentences))
        print("| method | words/s | vs fairseq fp32 | vs torch int8 | BLEU | same as fp32 | wall s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, r in rows.items():
            peer = rows.get(PEER)
            print("| {} | {:.0f} | {:.2f}x | {} | {:.2f} | {:.1f}% | {:.2f} |".format(
                name, r["words_per_s"], r["words_per_s"] / rows[BASELINE]["words_per_s"],
                "{:.2f}x".format(r["words_per_s"] / peer["words_per_s"]) if peer else "-",
                r["bleu"], 100 * r["same_as_fp32"], r["wall_s"]))
    print("\ntargets (--rnn-int16 = '{}'):".format(ALL_TRICKS))
    for setting, res in results.items():
        rows = res["rows"]
        if ALL_TRICKS not in rows or PEER not in rows:
            continue
        ours, peer, base = rows[ALL_TRICKS], rows[PEER], rows[BASELINE]
        print("  {}: {:.2f}x torch int8 (target >= 1.2x: {}); BLEU {:+.2f} vs fp32 (target within 0.1: {}); "
              "{:.2f}x fairseq fp32{}".format(
                  setting, ours["words_per_s"] / peer["words_per_s"],
                  "met" if ours["words_per_s"] >= 1.2 * peer["words_per_s"] else "missed",
                  ours["bleu"] - base["bleu"], "met" if abs(ours["bleu"] - base["bleu"]) <= 0.1 else "missed",
                  ours["words_per_s"] / base["words_per_s"],
                  " (target >= 3.5x: {})".format("met" if ours["words_per_s"] >= 3.5 * base["words_per_s"]
                                                 else "missed") if setting == "one at a time" else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=cpu_name(), python=platform.python_version(), torch=torch.__version__,
                           kernel=int16_linear.kernel(), args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
