"""Lean decoder step benchmark: per-call cost and end to end, against fairseq and CTranslate2.

One process, one model, the same fairseq batches for every method, one CPU
thread (torch, OpenMP/MKL and CTranslate2 alike):

1. **Per-call cost.** A call is one whole search step: the decoder forward
   and the search update that follows it. It is measured as the time between
   the starts of consecutive decoder forward calls within a batch (the last
   call of a batch, which has no successor there, is not measured), recorded
   by wrapping the forward entry: ``EnsembleModel.forward_decoder`` of
   fairseq's ``SequenceGenerator`` (on the generator's own model), and
   ``runner.step`` / ``runner.step_mixed`` of our ``BeamDecoder``. A linear
   least-squares fit ``time = fixed + per_row * rows`` over all measured calls
   of all timed rounds gives the fixed cost per call and the cost per row,
   for fairseq's generator (beam k and beam 1), and for our loop on each
   ``--runners`` runner (greedy, fixed k, var-batch k; var-stream too, whose
   intervals also hold the pool's refills, so read that fit with care).
2. **End to end** (wall clock: median of ``--repeats`` interleaved rounds;
   BLEU: sacreBLEU on detokenized output; decoder calls): greedy, fixed k=5
   (our ``finalize="fairseq"``, dense), var-batch k=5 (δ=1.5, M=5, ``stay``)
   and var-stream k=50 (the same search on the stream pool: ε=1/6 counting
   sentences, shortest first, pool = batch size, as bench_stream.py), for
   fairseq's generator where it has the search (beam 5; beam 1 as greedy),
   our loop on each runner, and CTranslate2 fp32 greedy and beam 5 on the same
   checkpoint converted by CTranslate2's own fairseq converter (see
   ``ctranslate2_peer.py``), one CTranslate2 call per fairseq batch. Then, per
   search, how many sentences' printed hypotheses (fairseq's H line text) are
   identical between runner lean and runner fairseq, and the BLEU difference.
3. **Targets** of the "lean decoder step" issue, as ratios: fixed per-call
   cost on the lean runner <= 3 ms; our greedy and fixed k=5 on lean within
   1.2x of CTranslate2 fp32's wall clock; our var-batch k=5 on lean faster
   than CTranslate2 beam 5 at equal or better BLEU; lean vs fairseq runner in
   float32: >= 99.5% identical hypotheses and BLEU within 0.05.

Max length: fairseq's default rule everywhere (max_len_a = 0, max_len_b = 200:
at most 200 tokens before EOS); CTranslate2 gets max_decoding_length = 200
(its limit counts tokens without EOS, and it has no per-source-length term,
which a = 0 does not need) and min_decoding_length = 1 (fairseq's min_len).

    python benchmarks/bench_step.py /work/m30k/probe \\
        --refs /work/shared/data/multi30k/test_2016_flickr.en [--runners fairseq lean] \\
        [--limit N] [--limit-k50 300] [--repeats 3] [--device cpu|cuda] [--ct2-dir DIR] [--json FILE]

``--beams K K_WIDE`` (default ``5 50``): k of greedy's companions (fairseq
beam, fixed, var-batch, CTranslate2 beam) and k of var-stream.
On ``--device cuda`` the per-call times are host times (no synchronization
is added per call) and wall clock is synchronized; CTranslate2 runs on cuda
where its wheel has CUDA, else it is skipped with a message.
"""

import preamble  # first: the import paths, then the threads before torch starts its pools

preamble.set_threads(1)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402

import ctranslate2_peer  # noqa: E402
from bench_search import add_input_arguments, bleu, load, make_batches, synchronize  # noqa: E402
from bench_stream import decode_stream  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.runners.fairseq_runner import ModelRunner  # noqa: E402
from fairseq_stream.runners.lean import LeanRunner  # noqa: E402

# The lean runner with one compiled part on its torch reference.
LEAN_VARIANTS = {
    "lean-torch-gemm": dict(prepack=False),  # F.linear instead of the MKL-prepacked products
    "lean-torch-attention": dict(compiled_attention=False),  # the attentions as torch ops
    "lean-python-step": dict(compiled_step=False),  # the layers' ops called from Python
    "lean-fairseq-encoder": dict(packed_encoder=False),  # fairseq's encoder instead of the packed one
}
from fairseq_stream.search.pruning import Pruning  # noqa: E402

# The targets.
FIXED_MS_TARGET = 3.0
CT2_RATIO_TARGET = 1.2
IDENTICAL_TARGET = 0.995
BLEU_DIFF_TARGET = 0.05
STREAM_EPS = 1 / 6


class CallLog:
    """(time, rows) at the start of every decoder forward call, grouped by batch."""

    def __init__(self):
        self.batches = []  # every timed run's batches, each a list of (perf_counter, rows)
        self.run_calls = self.run_rows = 0  # the last run's totals
        self._inside = False

    def new_run(self):
        self.run_calls = self.run_rows = 0

    def new_batch(self):
        self.batches.append([])

    def forget(self):
        """Drop what was recorded (a warm-up run)."""
        self.batches = []

    def wrap(self, forward, rows_of):
        """``forward`` recording (now, rows) at entry; a call made from inside another is not counted."""
        def wrapped(*args, **kwargs):
            # The stamp comes first: the interval to the next call's stamp
            # holds this forward and the search update after it, nothing of ours.
            now = time.perf_counter()
            if self._inside:  # e.g. a runner whose step_mixed calls its own step
                return forward(*args, **kwargs)
            rows = rows_of(args)
            self.batches[-1].append((now, rows))
            self.run_calls += 1
            self.run_rows += rows
            self._inside = True
            try:
                return forward(*args, **kwargs)
            finally:
                self._inside = False
        return wrapped

    def intervals(self):
        """(rows, seconds) of every call followed by another call of the same batch."""
        return [(r0, t1 - t0) for calls in self.batches for (t0, r0), (t1, _) in zip(calls, calls[1:])]


def fit(points):
    """Least squares ``seconds = fixed + per_row * rows``; the numbers in ms."""
    if len(points) < 2:
        return None
    x = np.array([r for r, _ in points], dtype=float)
    y = np.array([s for _, s in points], dtype=float)
    a = np.vstack([np.ones_like(x), x]).T
    (fixed, per_row), *_ = np.linalg.lstsq(a, y, rcond=None)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - (fixed + per_row * x)) ** 2).sum())
    return {
        "calls": len(points), "rows_min": int(x.min()), "rows_max": int(x.max()),
        "fixed_ms": 1000 * float(fixed), "per_row_ms": 1000 * float(per_row),
        # R² is undefined when every call has the same time (JSON has no NaN): None.
        "mean_ms": 1000 * float(y.mean()), "r2": 1 - ss_res / ss_tot if ss_tot > 0 else None,
    }


class Method:
    """One row of the end-to-end table: how to run it, and what it measured."""

    def __init__(self, search, impl, runner, k, run, log=None, convert=None):
        self.search, self.impl, self.runner, self.k = search, impl, runner, k
        self.run, self.log = run, log
        self.convert = convert  # raw results -> {sentence id: tokens}, after the clock stops
        self.walls, self.outputs = [], None

    @property
    def label(self):
        return self.impl if self.runner is None else "{} ({})".format(self.impl, self.runner)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_arguments(parser)
    parser.add_argument("--runners", nargs="+", default=["fairseq", "lean"],
                        choices=["fairseq", "lean"] + sorted(LEAN_VARIANTS),
                        help="our loop's runners to measure; the lean-torch-* variants are the lean runner with "
                             "one of its compiled parts replaced by its torch reference (what that part is worth)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; wall clock is the median")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size, and var-stream's pool size")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--output-layer", default="auto", choices=["auto", "torch", "fused"],
                        help="our decoders' output layer, as fairseq-generate's option (auto: the fused kernel "
                             "except for the dense fixed search, which keeps the reference)")
    parser.add_argument("--limit", type=int, default=0, help="only sentences with id < LIMIT (0: all)")
    parser.add_argument("--limit-k50", type=int, default=0,
                        help="var-stream at the wide k: only ids < this too (0: as --limit)")
    parser.add_argument("--ct2-dir", help="CTranslate2 model directory (default: next to the checkpoint, "
                        "converted there on first use)")
    parser.add_argument("--no-ct2", action="store_true", help="skip CTranslate2")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()
    if len(args.beams) != 2:
        parser.error("--beams takes two values: K (fixed, var-batch, fairseq and CTranslate2 beam) "
                     "and K_WIDE (var-stream)")
    k, k_wide = args.beams
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set by an earlier parallel call; intra-op is what matters here
        pass
    models, task = load(args.model_dir, args.checkpoints, args.device)
    d = task.target_dictionary
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "spm", "spm.model"))
    refs = open(args.refs, encoding="utf-8").read().splitlines()
    batches = make_batches(task, args.subset, args.batch_size, args.limit, args.device)
    limit_wide = min([n for n in (args.limit, args.limit_k50) if n] or [0])
    batches_wide = (batches if limit_wide == args.limit
                    else make_batches(task, args.subset, args.batch_size, limit_wide, args.device))
    n_sent = sum(len(b["id"]) for b in batches)
    n_wide = sum(len(b["id"]) for b in batches_wide)

    # Our decoders are built once, before any timing (the lean runner prepares
    # its weights when built; CTranslate2's model load is not timed either),
    # and reused by every round.
    var = Pruning(ap=1.5, mc=5)
    methods = []
    runner_classes = {}
    output_layers = {}  # search -> the output layer our decoders use ("torch": the reference)

    def fairseq_generator(search, beam):
        gen = SequenceGenerator(models, d, beam_size=beam)
        log = CallLog()
        # On the generator's own EnsembleModel instance, not the class: our
        # fairseq runner calls EnsembleModel.forward_decoder too.
        gen.model.forward_decoder = log.wrap(gen.model.forward_decoder, lambda a: a[0].size(0))

        def run():
            log.new_run()
            out = {}
            for sample in batches:
                log.new_batch()
                out.update(zip(sample["id"].tolist(), gen.generate(models, sample)))
            return {sid: hyps[0]["tokens"] for sid, hyps in out.items()}
        methods.append(Method(search, "fairseq generator (beam {})".format(beam), None, beam, run, log))

    def ours(search, beam, finalize, pruning, runner, stream=False):
        try:
            # The output layer as fairseq-generate picks it (--output-layer auto): greedy does not keep
            # the reference path (GreedySearch.build), the dense fixed search does.
            # A lean variant is handed ready: the decoder's bookkeeping moves the rows of the runner it was given.
            dec = BeamDecoder(models, d, beam_size=beam, finalize=finalize, pruning=pruning,
                              runner=LeanRunner(models, **LEAN_VARIANTS[runner]) if runner in LEAN_VARIANTS else runner,
                              output_layer=args.output_layer, keep_reference=False if beam == 1 else None)
        except ImportError as e:
            sys.exit("bench_step: runner {!r} is not available ({}); run with --runners fairseq".format(runner, e))
        # build_runner falls back to the fairseq runner for models the lean one
        # does not support, and says so only in the log: a row labelled lean
        # must measure lean.
        if runner != "fairseq" and isinstance(dec.runner, ModelRunner):
            sys.exit("bench_step: asked for runner {!r}, got the fairseq runner (the log says why)".format(runner))
        runner_classes[runner] = type(dec.runner).__name__
        output_layers[search] = dec.output_backend
        log = CallLog()
        dec.runner.step = log.wrap(dec.runner.step, lambda a: a[1].size(0))
        dec.runner.step_mixed = log.wrap(dec.runner.step_mixed, lambda a: a[1].size(0))
        if hasattr(dec.runner, "step_own"):
            dec.runner.step_own = log.wrap(dec.runner.step_own, lambda a: a[1].size(0))

        def run():
            log.new_run()
            if stream:
                # The whole stream is one "batch": its calls follow each other
                # across the pool's refills.
                log.new_batch()
                out = decode_stream(dec, batches_wide, args.batch_size, STREAM_EPS, "sentences", "shortest")
            else:
                out = {}
                for sample in batches:
                    log.new_batch()
                    out.update(zip(sample["id"].tolist(), dec.generate(models, sample)))
            return {sid: hyps[0]["tokens"] for sid, hyps in out.items()}
        methods.append(Method(search, "ours", runner, beam, run, log))

    ct2, ct2_note = setup_ct2(args, task)

    def ct2_method(search, beam):
        inputs = ct2.inputs(batches)

        def run():
            results = ct2.translate(inputs, beam)
            synchronize(args.device)
            return results
        # Pieces -> ids after the clock stops, for BLEU and comparisons as ours.
        methods.append(Method(search, "CTranslate2 fp32 ({})".format(
            "greedy" if beam == 1 else "beam {}".format(beam)), None, beam, run, convert=ct2.tokens))

    greedy, fixed = "greedy", "fixed k={}".format(k)
    varb, vars_ = "var-batch k={}".format(k), "var-stream k={}".format(k_wide)
    fairseq_generator(greedy, 1)
    for runner in args.runners:
        ours(greedy, 1, "fairseq", None, runner)
    if ct2:
        ct2_method(greedy, 1)
    fairseq_generator(fixed, k)
    for runner in args.runners:
        ours(fixed, k, "fairseq", None, runner)
    if ct2:
        ct2_method(fixed, k)
    for runner in args.runners:
        ours(varb, k, "stay", var, runner)
    for runner in args.runners:
        ours(vars_, k_wide, "stay", var, runner, stream=True)

    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else "cpu, 1 thread (torch, OMP/MKL, CTranslate2 intra/inter)")
    print("bench_step: {} sentences ({} at k={}), batch {}, {}, median of {} interleaved rounds, {}".format(
        n_sent, n_wide, k_wide, args.batch_size, where, args.repeats, time.strftime("%Y-%m-%d")), flush=True)
    print("runners: {}; CTranslate2: {}".format(
        ", ".join("{} ({})".format(r, runner_classes[r]) for r in args.runners), ct2_note), flush=True)
    print("output layer (--output-layer {}): {}".format(args.output_layer, ", ".join(
        "{} {}".format(search, "torch (reference)" if b == "torch" else "fused ({} kernel)".format(b))
        for search, b in output_layers.items())), flush=True)

    execute(methods, args)

    fits = report_fits(methods, args)
    rows = report_end_to_end(methods, task, sp, refs, d)
    exact = report_exactness(methods, rows, d, args)
    targets = report_targets(methods, rows, fits, exact, args, greedy, fixed, varb)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": where, "torch": torch.__version__,
                "ctranslate2": ct2_note, "sentences": n_sent, "sentences_wide": n_wide,
                "batch_size": args.batch_size, "repeats": args.repeats, "runners": runner_classes,
                "output_layers": output_layers,
                "beams": [k, k_wide], "max_len": "max_len_a=0, max_len_b={} (CTranslate2: max_decoding_length={}, "
                "min_decoding_length={})".format(ctranslate2_peer.MAX_LEN_B, ctranslate2_peer.MAX_LEN_B,
                                                 ctranslate2_peer.MIN_LEN),
                "per_call_fits": fits, "end_to_end": rows, "exactness": exact, "targets": targets,
            }, f, indent=1)
        print("wrote {}".format(args.json))


def setup_ct2(args, task):
    """The CTranslate2 peer, or None and why not."""
    if args.no_ct2:
        return None, "skipped (--no-ct2)"
    ctranslate2, why = ctranslate2_peer.import_ctranslate2()
    if ctranslate2 is None:
        print("CTranslate2 skipped: " + why, flush=True)
        return None, "skipped: " + why
    if ":" in args.checkpoints:
        why = "an ensemble ({}): CTranslate2's fairseq converter takes one checkpoint".format(args.checkpoints)
        print("CTranslate2 skipped: " + why, flush=True)
        return None, "skipped: " + why
    if args.device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        why = "this ctranslate2 {} wheel sees no CUDA device (built without CUDA, or its CUDA libraries " \
              "are missing)".format(ctranslate2.__version__)
        print("CTranslate2 skipped on cuda: " + why, flush=True)
        return None, "skipped: " + why
    checkpoint = os.path.join(args.model_dir, args.checkpoints)
    model_dir = ctranslate2_peer.converted_model(checkpoint, os.path.join(args.model_dir, "data-bin"),
                                                 args.ct2_dir, log=lambda s: print(s, flush=True))
    peer = ctranslate2_peer.CT2Peer(model_dir, args.device, task.source_dictionary, task.target_dictionary)
    return peer, "{} fp32 on {} ({})".format(ctranslate2.__version__, args.device, model_dir)


def execute(methods, args):
    """Every method once per round, ``--repeats`` rounds: slow drift of the machine hits all alike."""
    cuda = args.device == "cuda"
    if cuda:
        # CUDA contexts, kernels and allocators (torch's, each runner's and
        # CTranslate2's) warmed before timing: one untimed run of the first
        # method of each kind; these runs' call logs are dropped.
        first = {}
        for m in methods:
            first.setdefault((m.impl.split(" (")[0], m.runner), m)
        with torch.no_grad():
            for m in first.values():
                m.run()
                synchronize(args.device)
                if m.log:
                    m.log.forget()
    for rep in range(args.repeats):
        for m in methods:
            synchronize(args.device)
            start = time.perf_counter()
            with torch.no_grad():
                out = m.run()
            synchronize(args.device)
            m.walls.append(time.perf_counter() - start)
            m.outputs = m.convert(out) if m.convert else out
            # Progress on stderr: a run cut short still shows its timings.
            print("round {} | {} | {} | {:.2f} s".format(rep + 1, m.search, m.label, m.walls[-1]),
                  file=sys.stderr, flush=True)


def report_fits(methods, args):
    print()
    print("## Per-call cost: time between the starts of consecutive decoder calls in a batch "
          "(forward + search update{}), least squares t = fixed + per_row * rows, all {} rounds".format(
              ", host time" if args.device == "cuda" else "", args.repeats))
    print()
    print("| search | method | k | calls fitted | rows (min-max) | fixed (ms) | per row (ms) | mean (ms) | R² |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    fits = []
    for m in methods:
        if m.log is None:
            continue
        f = fit(m.log.intervals())
        if f is None:
            continue
        f.update(search=m.search, method=m.label, impl=m.impl, runner=m.runner, k=m.k)
        fits.append(f)
        r2 = "n/a" if f["r2"] is None else "{:.3f}".format(f["r2"])
        print("| {search} | {method} | {k} | {calls} | {rows_min}-{rows_max} | {fixed_ms:.3f} | {per_row_ms:.4f} | "
              "{mean_ms:.3f} | {r2} |".format(**dict(f, r2=r2)))
    print("(var-stream: its intervals also hold the pool's refills, encoder calls included)")
    return fits


def printed(tokens, d):
    """The hypothesis as fairseq-generate prints it on its H line (before detokenization)."""
    return d.string(tokens.cpu())


def same_share(a, b, d):
    ids = sorted(a)
    return sum(printed(a[i], d) == printed(b[i], d) for i in ids) / len(ids)


def report_end_to_end(methods, task, sp, refs, d):
    print()
    print("## End to end: wall clock (median), BLEU (sacreBLEU, detokenized), decoder calls and rows (one run)")
    print()
    print("| search | method | k | BLEU | wall clock (s) | decoder calls | rows | runs (s) | identical to |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for m in methods:
        # Compared with: lean with our fairseq runner; our fairseq runner with
        # fairseq's generator (the same search); CTranslate2 with our fairseq
        # runner's same search.
        ref = None
        if m.impl == "ours" and m.runner != "fairseq":
            ref = find(methods, m.search, "ours", "fairseq")
        elif m.impl == "ours":
            ref = find(methods, m.search, None, None, generator=True)
        elif m.log is None:
            ref = find(methods, m.search, "ours", "fairseq")
        same = ""
        if ref is not None:
            same = "{}: {:.1%}".format(ref.label, same_share(ref.outputs, m.outputs, d))
        row = {
            "search": m.search, "method": m.label, "impl": m.impl, "runner": m.runner, "k": m.k,
            "sentences": len(m.outputs), "bleu": bleu(m.outputs, task, sp, refs),
            "wall_s": statistics.median(m.walls), "walls": m.walls,
            "decoder_calls": m.log.run_calls if m.log else None, "rows": m.log.run_rows if m.log else None,
            "identical_to": same,
        }
        rows.append(row)
        print("| {} | {} | {} | {:.2f} | {:.2f} | {} | {} | {} | {} |".format(
            m.search, m.label, m.k, row["bleu"], row["wall_s"],
            "n/a" if m.log is None else row["decoder_calls"], "n/a" if m.log is None else row["rows"],
            " / ".join("{:.2f}".format(w) for w in m.walls), same))
    print("(CTranslate2's decoder calls are internal to it: n/a)")
    return rows


def find(methods, search, impl, runner, generator=False):
    for m in methods:
        if m.search != search:
            continue
        if generator and m.impl.startswith("fairseq generator"):
            return m
        if not generator and m.impl == impl and m.runner == runner:
            return m
    return None


def row_of(rows, search, impl, runner=None):
    for r in rows:
        if r["search"] == search and r["impl"].startswith(impl) and r["runner"] == runner:
            return r
    return None


def report_exactness(methods, rows, d, args):
    print()
    print("## Exactness: runner lean against runner fairseq, float32 (target: >= {:.1%} identical printed "
          "hypotheses, abs(BLEU diff) <= {})".format(IDENTICAL_TARGET, BLEU_DIFF_TARGET))
    print()
    if "lean" not in args.runners or "fairseq" not in args.runners:
        print("not measured: needs --runners fairseq lean")
        return []
    print("| search | k | identical | BLEU lean | BLEU fairseq | BLEU diff | met |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    out = []
    for m in methods:
        if m.impl != "ours" or m.runner != "lean":
            continue
        ref = find(methods, m.search, "ours", "fairseq")
        lean, fair = row_of(rows, m.search, "ours", "lean"), row_of(rows, m.search, "ours", "fairseq")
        share = same_share(ref.outputs, m.outputs, d)
        diff = lean["bleu"] - fair["bleu"]
        met = share >= IDENTICAL_TARGET and abs(diff) <= BLEU_DIFF_TARGET
        out.append({"search": m.search, "k": m.k, "identical": share, "bleu_lean": lean["bleu"],
                    "bleu_fairseq": fair["bleu"], "bleu_diff": diff, "met": met})
        print("| {} | {} | {:.2%} | {:.2f} | {:.2f} | {:+.2f} | {} |".format(
            m.search, m.k, share, lean["bleu"], fair["bleu"], diff, "yes" if met else "NO"))
    return out


def report_targets(methods, rows, fits, exact, args, greedy, fixed, varb):
    """The issue's targets side by side: each as a ratio, next to the ratio it must stay under."""
    runner = "lean" if "lean" in args.runners else args.runners[0]
    print()
    print("## Targets (runner {}{})".format(
        runner, "" if runner == "lean" else "; the lean runner was not run, so these are NOT the issue's numbers"))
    print()
    print("| target | measured | ratio | goal | met |")
    print("| --- | --- | --- | --- | --- |")
    out = []

    def line(name, measured, ratio, goal, met):
        out.append({"target": name, "runner": runner, "measured": measured, "ratio": ratio, "goal": goal,
                    "met": met})
        print("| {} | {} | {} | {} | {} |".format(
            name, measured, "n/a" if ratio is None else "{:.2f}".format(ratio), goal,
            "n/a" if met is None else ("yes" if met else "NO")))

    for search in (fixed, greedy, varb):
        f = next((f for f in fits if f["search"] == search and f["impl"] == "ours" and f["runner"] == runner), None)
        if f:
            line("fixed per-call cost, {}: fixed / {} ms".format(search, FIXED_MS_TARGET),
                 "{:.3f} ms".format(f["fixed_ms"]), f["fixed_ms"] / FIXED_MS_TARGET, "<= 1",
                 f["fixed_ms"] <= FIXED_MS_TARGET)
    ct2_greedy, ct2_beam = row_of(rows, greedy, "CTranslate2"), row_of(rows, fixed, "CTranslate2")
    for search, ct2 in ((greedy, ct2_greedy), (fixed, ct2_beam)):
        ours = row_of(rows, search, "ours", runner)
        name = "{} wall clock: ours / {}".format(search, ct2["method"] if ct2 else "CTranslate2 (skipped)")
        if ct2 is None:
            line(name, "{:.2f} s".format(ours["wall_s"]), None, "<= {}".format(CT2_RATIO_TARGET), None)
            continue
        ratio = ours["wall_s"] / ct2["wall_s"]
        line(name, "{:.2f} s / {:.2f} s".format(ours["wall_s"], ct2["wall_s"]), ratio,
             "<= {}".format(CT2_RATIO_TARGET), ratio <= CT2_RATIO_TARGET)
    ours = row_of(rows, varb, "ours", runner)
    if ct2_beam is None:
        line("{} wall clock: ours / CTranslate2 (skipped)".format(varb),
             "{:.2f} s, BLEU {:.2f}".format(ours["wall_s"], ours["bleu"]), None, "< 1, BLEU >=", None)
    else:
        ratio = ours["wall_s"] / ct2_beam["wall_s"]
        line("{} wall clock: ours / {}, at BLEU >=".format(varb, ct2_beam["method"]),
             "{:.2f} s / {:.2f} s; BLEU {:.2f} vs {:.2f}".format(
                 ours["wall_s"], ct2_beam["wall_s"], ours["bleu"], ct2_beam["bleu"]),
             ratio, "< 1, BLEU >=", ratio < 1 and ours["bleu"] >= ct2_beam["bleu"])
    for e in exact:
        line("runner lean = runner fairseq, {}: identical share".format(e["search"]),
             "{:.2%} identical, BLEU {:+.2f}".format(e["identical"], e["bleu_diff"]), e["identical"],
             ">= {}, abs(BLEU diff) <= {}".format(IDENTICAL_TARGET, BLEU_DIFF_TARGET), e["met"])
    return out


if __name__ == "__main__":
    main()
