"""Ensemble benchmark: N members against one, member by member (before) and stacked (after), with a breakdown.

One process, one CPU thread, the same inputs for every run, side by side:
for each ``--searches`` entry (``fixed``: k=5, ``--finalize fairseq``, on the
decoder's Python loop; ``var-stream``: k=5, δ=1.5, M=5, ``stay``, the stream
pool with ε=1/6) and each ``--quantize`` form (``none``: float32, ``int8``):

* ``1``: the first member alone;
* ``N before``: all N members, ``--no-stack-members`` (the lean runner's
  member-by-member step, each member's compiled layers);
* ``N after``: all N members stacked (:mod:`fairseq_stream.runners.stacked`).

Breakdown of each run (seconds): ``total`` (the decode), ``output`` (the
output layer's calls: the fused ensemble layer, timed where the decoder calls
it), ``products`` (every decoder product of every member: each member's own
product callables timed afterwards at each decoder call's row count, as the
run called them: the compiled step runs them inside C++, where no Python
timer reaches), ``encoder`` (every member's encoder and its keys, timed
around the runner's ``start``), ``encoder products`` (the part of ``encoder``
that is products: each member's encoder layers' and its decoder's key and
value projections, replayed at each call's token count as the decoder's are)
and ``other`` (the rest: embedding, attention, norms, the search). The issue's
CPU target: ``N after`` <= N x one member's products + one member's other work
(and output layer), i.e. nothing but the products grows with N. It is judged
twice: with the decoder's products only (``bound_s``, as before) and with the
encoder's products counted as products too (``bound_with_encoder_s``: the
issue names "the encoder's too" among a step's products).

Members are random (seeded, untrained) transformers of the chosen shape,
built in this process: ``m30k`` (Multi30k's: 3+3 layers, 256 dims, FFN 512,
4 heads, 8000 words) or ``wmt19`` (WMT'19's transformer-big: 6+6 layers,
1024 dims, FFN 8192, 16 heads, 42024 words, as scripts/make_wmt19_standin.py
builds). Untrained weights rarely end a sentence, so every sentence runs to
``--max-len`` tokens: the steps are the same for every run. Sources are
random words, ``--sentences`` of them in batches of ``--batch-size``.

    python benchmarks/bench_ensemble.py --shape m30k [--members 4] [--sentences 64] [--batch-size 32] \\
        [--max-len 20] [--searches fixed var-stream] [--quantize none int8] [--json FILE]
"""

import preamble  # first: the import paths, then the threads before torch starts its pools

preamble.set_threads(1)

import argparse  # noqa: E402
import collections  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.schedule.pool import StreamPool  # noqa: E402
from fairseq_stream.search.pruning import Pruning  # noqa: E402

SHAPES = {
    "m30k": dict(arch="transformer", vocab=8000, overrides=dict(
        encoder_layers=3, decoder_layers=3, encoder_embed_dim=256, decoder_embed_dim=256,
        encoder_ffn_embed_dim=512, decoder_ffn_embed_dim=512, encoder_attention_heads=4,
        decoder_attention_heads=4)),
    "wmt19": dict(arch="transformer_wmt_en_de_big", vocab=42024, overrides=dict(
        encoder_ffn_embed_dim=8192, decoder_ffn_embed_dim=8192)),
}
SEARCHES = {
    "fixed": dict(beam_size=5, finalize="fairseq"),
    "var-stream": dict(beam_size=5, finalize="stay", pruning=Pruning(ap=1.5, mc=5)),
}


# The clock every figure reads: wall time, or with --clock cpu this thread's CPU time (the decode runs on one
# thread), which leaves out the time other processes take the core from it on a shared machine.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


class _Task:
    """What fairseq's ``build_model`` reads of a task: its dictionaries (one, joined)."""

    def __init__(self, dictionary):
        self.source_dictionary = self.target_dictionary = dictionary


def members(shape: str, count: int):
    """``count`` random transformers of ``shape`` (seeds 1..count) and their dictionary."""
    from fairseq.data import Dictionary
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    spec = SHAPES[shape]
    d = Dictionary()
    for i in range(spec["vocab"] - len(d)):
        d.add_symbol("w{}".format(i))
    out = []
    for seed in range(1, count + 1):
        args = argparse.Namespace(arch=spec["arch"], share_all_embeddings=True, dropout=0.0, **spec["overrides"])
        ARCH_CONFIG_REGISTRY[spec["arch"]](args)
        torch.manual_seed(seed)
        out.append(ARCH_MODEL_REGISTRY[spec["arch"]].build_model(args, _Task(d)).eval())
    return out, d


def sources(d, sentences: int, batch_size: int):
    """Batches of random sources (3 to 30 words, seeded), as fairseq's collater makes them."""
    from fairseq.data import LanguagePairDataset

    gen = torch.Generator().manual_seed(0)
    src = [torch.cat([torch.randint(d.nspecial, len(d), (int(n),), generator=gen), torch.tensor([d.eos()])])
           for n in torch.randint(3, 31, (sentences,), generator=gen)]
    dataset = LanguagePairDataset(src, [s.numel() for s in src], d)
    return [dataset.collater([dataset[i] for i in range(j, min(j + batch_size, sentences))])
            for j in range(0, sentences, batch_size)]


def timed(obj, name, sink):
    """Wrap ``obj.name`` so that each call's seconds add to ``sink[name]``; returns the wrapper's rows log."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            sink[name] += clock() - start

    setattr(obj, name, wrapper)


def product_inputs(lean):
    """One member's decoder products (the ``LeanModel``'s callables) with their input widths."""
    decoder = lean.model.decoder
    ffn = decoder.layers[0].fc1.out_features
    out = []
    for layer in lean.layers:
        out += [(layer.qkv, lean.dim), (layer.self_out, lean.dim), (layer.cross_q, lean.dim),
                (layer.cross_out, lean.dim), (layer.fc1, lean.dim), (layer.fc2, ffn)]
    out.append((lean.output, decoder.output_projection.in_features))
    return out


def encoder_product_inputs(lean):
    """One member's encoder products (its lean encoder's layers, then the decoder's encoder key and value
    projections) with their input widths; none where fairseq's encoder runs."""
    if lean.encoder is None or lean.encoder.compiled is None:
        return []
    ffn = lean.model.encoder.layers[0].fc1.out_features
    out = [(p, w) for layer in lean.encoder.products for p, w in zip(layer, (lean.dim, lean.dim, lean.dim, ffn))]
    return out + [(layer.cross_kv, lean.dim) for layer in lean.layers]


def replay_products(leans, rows, repeats: int = 3, inputs_of=product_inputs) -> float:
    """Seconds of every member's products at the run's row counts (``rows``: Counter rows -> calls).

    Per row count, a call's products are run as a step runs them, every member's in turn (so the members'
    weights pass through the caches as in the run), the fastest of ``repeats`` passes, times its calls.
    ``inputs_of``: the products of one member (the decoder's; :func:`encoder_product_inputs`).
    """
    total = 0.0
    for count, calls in sorted(rows.items()):
        products = [p for lean in leans for p in inputs_of(lean)]
        inputs = [torch.randn(count, width) for _, width in products]
        best = None
        for _ in range(repeats + 1):  # the first pass warms (first-touch of the outputs)
            start = clock()
            for (p, _), x in zip(products, inputs):
                p(x)
            took = clock() - start
            best = took if best is None else min(best, took)
        total += calls * best
    return total


def run(models, d, batches, search, quantize, stack, max_len):
    """One decode of ``batches``: (total, {output layer, encoder} seconds, rows Counter, the runner's LeanModels,
    each sentence's best tokens, the encoder's tokens Counter)."""
    dec = BeamDecoder(models, d, runner="lean", output_layer="auto", keep_reference=False, stack_members=stack,
                      quantize=quantize, max_len_a=0, max_len_b=max_len, min_len=max_len, **SEARCHES[search])
    assert (dec.runner.stacked is not None) == (stack and len(models) > 1)
    dec.compiled_loop = False  # the step under test, not the compiled search loop (which is member by member)
    sink, rows = collections.defaultdict(float), collections.Counter()
    timed(dec, "top_candidates", sink)
    timed(dec.runner, "start", sink)  # the encoder (every member's), once per batch or cohort
    start_encoder, tokens = dec.runner.start, collections.Counter()

    def counting_tokens(net_input, *args, **kwargs):
        tokens[int(net_input["src_tokens"].ne(d.pad()).sum())] += 1
        return start_encoder(net_input, *args, **kwargs)

    dec.runner.start = counting_tokens
    forward = dec.runner._forward

    def counting(segments, last_tokens, logits=False):
        rows[last_tokens.numel()] += 1
        return forward(segments, last_tokens, logits)

    dec.runner._forward = counting
    start = clock()
    with torch.no_grad():
        if search == "var-stream":
            pool = StreamPool(dec, len(batches[0]["id"]), eps=1 / 6, refill_unit="sentences", order="shortest")
            out = dict(pool.run(dec.open(s["net_input"], ids=s["id"]) for s in batches))
        else:
            out = {i: h for s in batches for i, h in zip(s["id"].tolist(), dec.generate(models, s))}
    total = clock() - start
    best = {i: h[0]["tokens"].tolist() for i, h in out.items()}
    return total, dict(output_s=sink["top_candidates"], encoder_s=sink["start"]), rows, dec.runner.lean, best, tokens


def measure(models, d, batches, search, quantize, args):
    """The three runs (1 member, N before, N after), interleaved ``--repeats`` times; the fastest of each.

    Each run's products are replayed after its first round (the row counts are the same every round: the
    same inputs, the same output), while its weights are still loaded. Progress goes to stderr.
    """
    plan = [("1", models[:1], False), ("{} before".format(len(models)), models, False),
            ("{} after".format(len(models)), models, True)]
    best, products, encoder_products, hyps = {}, {}, {}, {}
    for _ in range(args.repeats):
        for label, used, stack in plan:
            total, parts, rows, leans, found, tokens = run(used, d, batches, search, quantize, stack, args.max_len)
            print("  {} {} {}: {:.2f} s".format(search, quantize, label, total), file=sys.stderr, flush=True)
            if label not in products:
                products[label] = replay_products(leans, rows)
                encoder_products[label] = replay_products(leans, tokens, inputs_of=encoder_product_inputs)
                hyps[label] = found
            if label not in best or total < best[label]["total_s"]:
                best[label] = dict(total_s=total, **parts, calls=sum(rows.values()),
                                   rows=sum(k * v for k, v in rows.items()))
            del leans
            gc.collect()
    # Both N-member runs call the same products at the same row counts (the stacked step calls each member's
    # own on its rows, on the CPU), so one figure serves both: the lower replay, the less disturbed by load.
    products[plan[1][0]] = products[plan[2][0]] = min(products[plan[1][0]], products[plan[2][0]])
    out = []
    for label, _, _ in plan:
        r = dict(run=label, search=search, quantize=quantize, products_s=products[label],
                 encoder_products_s=encoder_products[label], **best[label])
        r["other_s"] = r["total_s"] - r["output_s"] - r["products_s"] - r["encoder_s"]
        r["after_prints_before"] = hyps[plan[1][0]] == hyps[plan[2][0]]
        out.append(r)
    return out


def report(rows, members):
    """The table, and per (search, quantize) the ratios and the target."""
    print("{:>10} {:>5} {:>9} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} | {:>6} {:>7}".format(
        "search", "quant", "run", "total s", "products", "output", "encoder", "enc prod", "other", "calls", "rows"))
    for r in rows:
        print("{search:>10} {quantize:>5} {run:>9} | {total_s:>8.2f} {products_s:>8.2f} {output_s:>8.2f} "
              "{encoder_s:>8.2f} {encoder_products_s:>8.2f} {other_s:>8.2f} | {calls:>6} {rows:>7}".format(**r))
    verdicts = []
    for i in range(0, len(rows), 3):
        one, before, after = rows[i: i + 3]
        bound = members * one["products_s"] + one["total_s"] - one["products_s"]
        met = after["total_s"] <= bound
        both = one["products_s"] + one["encoder_products_s"]
        bound_with_encoder = members * both + one["total_s"] - both
        verdicts.append(dict(search=one["search"], quantize=one["quantize"],
                             before_over_one=before["total_s"] / one["total_s"],
                             after_over_one=after["total_s"] / one["total_s"],
                             after_over_before=after["total_s"] / before["total_s"], bound_s=bound, met=met,
                             bound_with_encoder_s=bound_with_encoder,
                             met_with_encoder=after["total_s"] <= bound_with_encoder,
                             before_met_with_encoder=before["total_s"] <= bound_with_encoder,
                             same_output=after["after_prints_before"]))
        print("{} {}: {} members before {:.2f}x one member, after {:.2f}x (after/before {:.2f}); target "
              "{:.2f} s (N x products + one member's rest): {} ({:.2f} s); after prints before's best: {}".format(
                  one["search"], one["quantize"], members, verdicts[-1]["before_over_one"],
                  verdicts[-1]["after_over_one"], verdicts[-1]["after_over_before"], bound,
                  "met" if met else "MISSED", after["total_s"], after["after_prints_before"]))
        print("  with the encoder's products as products: target {:.2f} s: before {} ({:.2f} s), after {}".format(
            bound_with_encoder, "met" if verdicts[-1]["before_met_with_encoder"] else "MISSED", before["total_s"],
            "met" if verdicts[-1]["met_with_encoder"] else "MISSED"))
    return verdicts


def machine():
    """The CPU, its SIMD level, torch, the load, the commit: recorded with the numbers."""
    from fairseq_stream import cpu_info
    from fairseq_stream.ops import product

    commit = os.popen("git -C {} rev-parse --short HEAD 2>/dev/null".format(preamble.REPO)).read().strip()
    return dict(cpu=cpu_info.cpu_model() or platform.processor(), simd=cpu_info.simd_level(),
                skinny=product.skinny_kernel(), torch=torch.__version__, threads=torch.get_num_threads(),
                load=os.getloadavg(), commit=commit or None, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="m30k")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=20, help="tokens every sentence runs (EOS banned before)")
    parser.add_argument("--searches", nargs="+", choices=sorted(SEARCHES), default=["fixed", "var-stream"])
    parser.add_argument("--quantize", nargs="+", choices=["none", "int8"], default=["none", "int8"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or this thread's CPU time (steadier on a machine that other work shares)")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]

    torch.set_num_threads(1)
    where = machine()
    print("fairseq-stream ensemble benchmark: {cpu}, SIMD {simd}, torch {torch}, {threads} thread, load {load}, "
          "commit {commit}, {date}".format(**where))
    models, d = members(args.shape, args.members)
    batches = sources(d, args.sentences, args.batch_size)
    print("{} random {}-shaped members; {} random sources in batches of {}; {} tokens each; fastest of {}; {} "
          "time".format(args.members, args.shape, args.sentences, args.batch_size, args.max_len, args.repeats,
                        args.clock), flush=True)
    rows = []
    for quantize in args.quantize:
        for search in args.searches:
            rows += measure(models, d, batches, search, quantize, args)
    verdicts = report(rows, args.members)
    where["load_after"] = os.getloadavg()
    print("load after: {}".format(where["load_after"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=where, args=vars(args), rows=rows, verdicts=verdicts), f, indent=1)


if __name__ == "__main__":
    main()
