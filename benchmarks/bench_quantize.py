"""Quantized decoding (``--quantize int8|int16``) against our float32 and CTranslate2 float32 and int8.

One process, one model, the same fairseq batches for every method, one CPU
thread (torch, OpenMP/MKL and CTranslate2 alike), interleaved rounds, the
median wall clock of decoding (models loaded and weights quantized before
the clock starts, on both sides). Per search (greedy, fixed k, var-batch k
with δ=1.5, M=5; CTranslate2 runs greedy and beam k):

* our lean runner in float32, int8 and int16 (``--quantize``), and
  CTranslate2 4.8.5 with ``compute_type`` float32 and int8 on the checkpoint
  converted by its own fairseq converter (``ctranslate2_peer.py``);
* BLEU (sacreBLEU, detokenized), and the share of sentences whose printed
  hypothesis is identical to the same side's float32 one (ours int8 against
  ours float32, CTranslate2 int8 against CTranslate2 float32);
* the targets of the quantized-decoding issue as ratios: our int8 time over
  CTranslate2 int8's (greedy <= 1.0, fixed k <= 1.0 its beam k, var-batch k
  <= 0.75 its beam k); int16 >= 99% identical and BLEU within 0.1 of our
  float32; int8 BLEU within 0.3 and more sentences identical to our float32
  than CTranslate2 int8 keeps to its own float32;
* memory: the weights each of our decoders holds (its arranged copies:
  MKL-packed float, or quantized) and the model's float parameters it still
  reads (all of them in float32; embeddings, positions, norms and biases
  quantized: the CLI and the API release the rest), and which kernel ran.

    python benchmarks/bench_quantize.py runs/m30k --refs DATA/test_2016_flickr.en \\
        [--batch-size 64] [--limit N] [--repeats 3] [--searches greedy fixed var-batch] [--json FILE]

``--batch-size 1`` measures one sentence at a time (the latency case).
"""

import preamble  # noqa: F401  (first: before torch)

preamble.set_threads(1)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402

import ctranslate2_peer  # noqa: E402
from bench_search import add_input_arguments, bleu, load, make_batches  # noqa: E402
from bench_step import Method, execute, same_share  # noqa: E402

from fairseq_stream import cpu_info  # noqa: E402
from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.ops import quantized_linear  # noqa: E402
from fairseq_stream.search.pruning import Pruning  # noqa: E402

PRECISIONS = ("float32",) + quantized_linear.CHOICES  # int8: the CPU's form (int8w8 or int8w7)
DEFAULT_PRECISIONS = ("float32", "int8", "int16")
SEARCHES = ("greedy", "fixed", "var-batch")
# The issue's targets: our int8 time over CTranslate2 int8's, per search.
TIME_TARGETS = {"greedy": 1.0, "fixed": 1.0, "var-batch": 0.75}
INT16_IDENTICAL, INT16_BLEU = 0.99, 0.1
INT8_BLEU = 0.3
# Variables that cap the instruction sets of torch and our kernels, MKL, oneDNN and CTranslate2: set to
# AVX2 on an AVX-512 machine, they run the paths an AVX2-only CPU runs (docs/quantize.md).
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA", "CT2_FORCE_CPU_ISA")


def product_bytes(product):
    """What a lean product holds besides the model's own parameters: an MKL-packed float copy, or the
    quantized weight (with its scales, and oneDNN's transposed copy where it is used)."""
    held = [getattr(product, name, None) for name in ("packed", "weight_inv", "weight_kn")]
    held = [t for t in held if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in held)


def weight_mb(runner):
    """(MB of arranged weights, MB of the model's float parameters the runner still reads), per runner.

    A quantized runner reads the float embeddings, positions, norms and biases;
    the CLI and the API release the float matrices it replaces
    (``LeanRunner.release_float_weights``). A float32 runner reads every
    parameter, beside its MKL-packed copies.
    """
    from fairseq_stream.runners.lean import quantized_modules

    arranged = 0
    for lean in runner.lean:
        products = [lean.output, lean.project_in, lean.project_out]
        for layer in lean.layers:
            products += [layer.qkv, layer.self_out, layer.cross_q, layer.cross_kv, layer.cross_out, layer.fc1,
                         layer.fc2]
        arranged += sum(product_bytes(p) for p in products if p is not None)
        if lean.encoder is not None and lean.encoder.compiled is not None:
            arranged += sum(product_bytes(p) for layer in getattr(lean.encoder, "products", []) for p in layer)
    params = {id(p): p for m in runner.model.models for p in m.parameters()}
    floats = sum(p.numel() * p.element_size() for p in params.values())
    if runner.quantize is not None:
        replaced = {id(m.weight): m.weight for model, lean in zip(runner.model.models, runner.lean)
                    for m in quantized_modules(model, lean, runner.packed_encoder)}
        floats -= sum(w.numel() * w.element_size() for w in replaced.values())
    return arranged / 2 ** 20, floats / 2 ** 20


def search_options(search, k):
    """BeamDecoder options, and CTranslate2's beam, of a search."""
    if search == "greedy":
        return dict(beam_size=1, keep_reference=False), 1
    if search == "fixed":
        return dict(beam_size=k, finalize="fairseq", keep_reference=False), k
    return dict(beam_size=k, finalize="stay", pruning=Pruning(ap=1.5, mc=5)), k


def our_method(models, task, batches, search, k, precision, memory):
    """Our lean runner at ``precision``; ``memory[label]`` gets the resident MB its weights added."""
    options, beam = search_options(search, k)
    dec = BeamDecoder(models, task.target_dictionary, runner="lean", output_layer="auto",
                      quantize="none" if precision == "float32" else precision, **options)
    label = "ours {}".format(precision)
    memory.setdefault(label, weight_mb(dec.runner))

    def run():
        out = {}
        for sample in batches:
            out.update(zip(sample["id"].tolist(), dec.generate(models, sample)))
        return {sid: hyps[0]["tokens"] for sid, hyps in out.items()}
    return Method(search, label, None, beam, run)


def ct2_method(peer, inputs, search, k):
    _, beam = search_options(search, k)
    return Method(search, "CTranslate2 {}".format(peer.compute_type), None, beam,
                  lambda: peer.translate(inputs, beam), convert=peer.tokens)


def setup_ct2(args, task, batches):
    """{compute type: CT2Peer} and its inputs, or ({}, None) with the reason printed."""
    if args.no_ct2:
        return {}, None, "skipped (--no-ct2)"
    ctranslate2, why = ctranslate2_peer.import_ctranslate2()
    if ctranslate2 is None:
        print("CTranslate2 skipped: " + why, flush=True)
        return {}, None, "skipped: " + why
    model_dir = ctranslate2_peer.converted_model(os.path.join(args.model_dir, args.checkpoints),
                                                 os.path.join(args.model_dir, "data-bin"), args.ct2_dir,
                                                 log=lambda s: print(s, flush=True))
    peers = {t: ctranslate2_peer.CT2Peer(model_dir, "cpu", task.source_dictionary, task.target_dictionary, t)
             for t in ("float32", "int8")}
    return peers, peers["float32"].inputs(batches), "{} ({})".format(ctranslate2.__version__, model_dir)


def report(methods, task, sp, refs, d):
    """The end-to-end table; {(search, label): row}."""
    print()
    print("## Decoding: wall clock (median of the rounds), BLEU, identical to the same side's float32")
    print()
    print("| search | method | k | BLEU | wall clock (s) | runs (s) | identical to float32 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = {}
    for m in methods:
        side = "ours" if m.impl.startswith("ours") else "CTranslate2"
        ref = next(r for r in methods if r.search == m.search and r.impl == side + " float32")
        row = {"search": m.search, "method": m.impl, "k": m.k, "sentences": len(m.outputs),
               "bleu": bleu(m.outputs, task, sp, refs), "wall_s": statistics.median(m.walls), "walls": m.walls,
               "identical_to_float32": same_share(ref.outputs, m.outputs, d)}
        rows[(m.search, m.impl)] = row
        print("| {} | {} | {} | {:.2f} | {:.2f} | {} | {:.1%} |".format(
            m.search, m.impl, m.k, row["bleu"], row["wall_s"], " / ".join("{:.2f}".format(w) for w in m.walls),
            row["identical_to_float32"]))
    return rows


def targets(rows, searches):
    """The issue's targets as measured ratios; printed and returned."""
    out = []

    def add(name, value, goal, met, fmt="{:.2f}"):
        out.append({"target": name, "measured": value, "goal": goal, "met": bool(met)})
        print("| {} | {} | {} | {} |".format(name, fmt.format(value), goal, "yes" if met else "NO"))

    print()
    print("## Targets")
    print()
    print("| target | measured | goal | met |")
    print("| --- | --- | --- | --- |")
    for search in searches:
        row = lambda impl: rows.get((search, impl))  # noqa: E731
        f32, i8, i16, ct8 = row("ours float32"), row("ours int8"), row("ours int16"), row("CTranslate2 int8")
        if i8 and ct8:
            ratio = i8["wall_s"] / ct8["wall_s"]
            add("{}: our int8 time / CTranslate2 int8's".format(search), ratio,
                "<= {:.2f}".format(TIME_TARGETS[search]), ratio <= TIME_TARGETS[search])
        if i8 and f32:
            diff = i8["bleu"] - f32["bleu"]
            add("{}: int8 BLEU - float32 BLEU".format(search), diff, ">= -{}".format(INT8_BLEU), diff >= -INT8_BLEU,
                "{:+.2f}")
            if ct8:
                add("{}: int8 identical to float32, ours - CTranslate2's".format(search),
                    i8["identical_to_float32"] - ct8["identical_to_float32"], "> 0",
                    i8["identical_to_float32"] > ct8["identical_to_float32"], "{:+.1%}")
        if i16 and f32:
            add("{}: int16 identical to float32".format(search), i16["identical_to_float32"],
                ">= {:.0%}".format(INT16_IDENTICAL), i16["identical_to_float32"] >= INT16_IDENTICAL, "{:.1%}")
            diff = i16["bleu"] - f32["bleu"]
            add("{}: int16 BLEU - float32 BLEU".format(search), diff, "within {}".format(INT16_BLEU),
                abs(diff) <= INT16_BLEU, "{:+.2f}")
    return out


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_arguments(p)
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch (1: one at a time)")
    p.add_argument("--limit", type=int, default=0, help="only sentences with id < LIMIT (0: all)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; wall clock is the median")
    p.add_argument("--searches", nargs="+", default=list(SEARCHES), choices=SEARCHES)
    p.add_argument("--precisions", nargs="+", default=list(DEFAULT_PRECISIONS), choices=PRECISIONS,
                   help="ours (float32 is always run: the reference); int8 is the form the CPU runs fastest, "
                   "int8w8 and int8w7 fix the width of its weights")
    p.add_argument("--ct2-dir", help="CTranslate2 model directory (default: next to the checkpoint)")
    p.add_argument("--no-ct2", action="store_true", help="skip CTranslate2")
    p.add_argument("--json", help="write every number here")
    return p


def main():
    args = parser().parse_args()
    k = args.beams[0]
    torch.set_num_threads(1)
    models, task = load(args.model_dir, args.checkpoints)
    d = task.target_dictionary
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "spm", "spm.model"))
    refs = open(args.refs, encoding="utf-8").read().splitlines()
    batches = make_batches(task, args.subset, args.batch_size, args.limit)
    peers, inputs, ct2_note = setup_ct2(args, task, batches)
    precisions = ["float32"] + [p for p in args.precisions if p != "float32"]
    memory, methods = {}, []
    for search in args.searches:
        methods += [our_method(models, task, batches, search, k, p, memory) for p in precisions]
        methods += [ct2_method(peer, inputs, search, k) for peer in peers.values()]
    n = sum(len(b["id"]) for b in batches)
    caps = {v: os.environ[v] for v in ISA_CAPS if os.environ.get(v)}
    print("bench_quantize: {} sentences, batch {}, {} ({}), 1 thread, median of {} interleaved rounds, {}; "
          "int8 as {} on the {} kernel, int16 kernel {}; CTranslate2 {}; instruction sets capped by {}".format(
              n, args.batch_size, cpu_info.cpu_model(), cpu_info.simd_level(), args.repeats,
              time.strftime("%Y-%m-%d"), quantized_linear.resolve("int8"), quantized_linear.kernel("int8"),
              quantized_linear.kernel("int16"),
              ct2_note, caps or "nothing"), flush=True)
    print("weights each of our decoders holds (arranged copies + the model's float parameters it still "
          "reads): " + ", ".join("{} {:.1f} + {:.1f} MB".format(label, *mb) for label, mb in memory.items()),
          flush=True)
    execute(methods, argparse.Namespace(device="cpu", repeats=args.repeats))
    rows = report(methods, task, sp, refs, d)
    met = targets(rows, args.searches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_info.cpu_model(),
                       "simd": cpu_info.simd_level(), "isa_caps": caps, "torch": torch.__version__, "ctranslate2": ct2_note,
                       "kernels": {"int8": quantized_linear.kernel("int8"), "int16": quantized_linear.kernel("int16")},
                       "int8_form": quantized_linear.resolve("int8"),
                       "sentences": n, "batch_size": args.batch_size, "repeats": args.repeats, "beam": k,
                       "memory_mb": memory, "rows": list(rows.values()), "targets": met,
                       "command": " ".join(sys.argv)}, f, indent=1)
        print("wrote {}".format(args.json))


if __name__ == "__main__":
    main()
