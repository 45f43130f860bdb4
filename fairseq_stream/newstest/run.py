"""``scripts/newstest.sh PAIR YEAR METHOD``: decode a newstest set with one method, score it, record it.

METHOD is a ``--preset`` name (``fairseq_stream/presets``): ``beam`` is
fairseq's own beam search, the others run on this plugin. The steps:
the test set (local text or sacreBLEU), the model's tokenizer and BPE,
binarizing with its dictionaries (cached), fairseq-generate with the plugin,
its D- lines (detokenized by fairseq itself), sacreBLEU against the raw
reference, and a JSON line appended to the results file.
"""

import argparse
import datetime
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time
from typing import List, Optional

from fairseq_stream import presets
from fairseq_stream.newstest import NewstestError, exit_on_signals
from fairseq_stream.newstest import prepare as prep
from fairseq_stream.newstest import testset as ts

PROG = "newstest.sh"
# The directory scripts/download_wmt19.sh unpacks each pair's ensemble into.
WMT19_NAMES = {"de-en": "wmt19.de-en.joined-dict.ensemble", "ru-en": "wmt19.ru-en.ensemble"}
TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s")


def parser() -> argparse.ArgumentParser:
    """The command line of ``scripts/newstest.sh``."""
    p = argparse.ArgumentParser(
        prog="newstest.sh",
        description="Translate newstestYEAR with one method, score it with sacreBLEU and append a JSON "
                    "line to the results file. Options after -- go to fairseq-generate as typed.",
        epilog="WMT'19 example: scripts/download_wmt19.sh de-en wmt19 && scripts/newstest.sh de-en 2018 "
               "var-stream --beam 50. Offline, any model: --models DIR --checkpoints a.pt --srcdict ... "
               "--tokenizer none --bpe sentencepiece --sentencepiece-model spm.model --source F --reference F")
    p.add_argument("pair", metavar="PAIR", help="SRC-TGT, e.g. de-en or ru-en")
    p.add_argument("year", metavar="YEAR", help="newstest year, e.g. 2017 (dev) or 2018 (test)")
    p.add_argument("method", metavar="METHOD",
                   help="a --preset name or file; beam is fairseq's own beam search (choose from: {})".format(
                       ", ".join(methods())))
    m = p.add_argument_group("model")
    m.add_argument("--models", metavar="DIR",
                   help="the ensemble's directory (default: $WMT19_DIR/NAME as scripts/download_wmt19.sh "
                        "unpacks it, WMT19_DIR=wmt19)")
    m.add_argument("--checkpoints", metavar="A.pt:B.pt",
                   help="checkpoints, relative to --models (default: every model*.pt there, in number order)")
    m.add_argument("--srcdict", metavar="FILE", help="default: DIR/dict.SRC.txt")
    m.add_argument("--tgtdict", metavar="FILE", help="default: DIR/dict.TGT.txt")
    m.add_argument("--tokenizer", choices=prep.TOKENIZERS, default="moses", help="default: moses (WMT'19)")
    m.add_argument("--bpe", choices=prep.BPES, default="fastbpe", help="default: fastbpe (WMT'19)")
    m.add_argument("--bpe-codes", metavar="FILE", help="fastBPE codes (default: DIR/bpecodes)")
    m.add_argument("--sentencepiece-model", metavar="FILE")
    t = p.add_argument_group("test set")
    t.add_argument("--text-dir", metavar="DIR",
                   help="local plain text: DIR/newstestYEAR.SRC and .TGT, one sentence a line "
                        "(default: sacreBLEU downloads the test set)")
    t.add_argument("--source", metavar="FILE", help="any source file (with --reference): overrides YEAR")
    t.add_argument("--reference", metavar="FILE")
    t.add_argument("--limit", type=int, metavar="N", help="the first N sentences only (quick runs)")
    r = p.add_argument_group("run")
    r.add_argument("--beam", type=int, metavar="K", help="beam size (default: the preset's)")
    r.add_argument("--batch-size", type=int, metavar="N",
                   help="sentences per batch (default 32, or the --gpu-memory preset's)")
    r.add_argument("--gpu-memory", choices=("16", "32"),
                   help="batch size for the WMT'19 ensemble on a 16 or 32 GB GPU (presets gpuNgb-kK; beam 5 or 50)")
    r.add_argument("--cpu", action="store_true", help="decode on the CPU even if a GPU is present")
    r.add_argument("--runs", type=int, default=1, metavar="R", help="repeat the decoding R times (default 1)")
    r.add_argument("--results", default="results/newstest.jsonl", metavar="FILE",
                   help="JSON lines file the rows are appended to (default: %(default)s)")
    r.add_argument("--work-dir", default="results/work", metavar="DIR",
                   help="prepared inputs (cached) and fairseq-generate's outputs (default: %(default)s)")
    r.add_argument("--grid", metavar="ID",
                   help="label the rows with this grid run's ID (newstest_all.sh sets it; report.py --grid "
                        "ID reports those rows only)")
    return p


def methods() -> List[str]:
    """The presets that are decoding methods (add-ons such as gpu32gb-k5 or cpu-int8 go after ``--``)."""
    return presets.method_names()


def split_argv(argv: List[str]):
    """Our options, and fairseq-generate's after ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _number(path: str):
    digits = re.findall(r"\d+", os.path.basename(path))
    return (int(digits[-1]) if digits else -1, path)


def resolve_model(args) -> dict:
    """Checkpoints, dictionaries and encoding from ``--models`` and its defaults; one-line errors."""
    src, tgt = args.pair.split("-")
    models = args.models or os.path.join(os.environ.get("WMT19_DIR", "wmt19"), WMT19_NAMES.get(args.pair, ""))
    if not os.path.isdir(models):
        hint = (" (fetch it: scripts/download_wmt19.sh {} {})".format(args.pair, os.path.dirname(models))
                if args.models is None and args.pair in WMT19_NAMES else "")
        raise NewstestError("--models {}: no such directory{}".format(models, hint))
    if args.checkpoints:
        checkpoints = [os.path.join(models, c) for c in args.checkpoints.split(":")]
    else:
        checkpoints = sorted(glob.glob(os.path.join(models, "model*.pt")), key=_number)
    if not checkpoints:
        raise NewstestError("--models {}: no model*.pt (name them with --checkpoints)".format(models))
    for c in checkpoints:
        if not os.path.isfile(c):
            raise NewstestError("checkpoint {}: no such file".format(c))
    codes = args.bpe_codes or (os.path.join(models, "bpecodes") if args.bpe == "fastbpe" else None)
    encoding = prep.Encoding(args.tokenizer, args.bpe, codes, args.sentencepiece_model)
    return dict(
        checkpoints=checkpoints,
        srcdict=args.srcdict or os.path.join(models, "dict.{}.txt".format(src)),
        tgtdict=args.tgtdict or os.path.join(models, "dict.{}.txt".format(tgt)),
        encoding=encoding,
    )


def preset_search(method: str) -> Optional[str]:
    """The ``--search`` a method's preset selects (None: fairseq's own beam search)."""
    options = presets.options_of(method)
    found = None
    for i, o in enumerate(options):
        if o == "--search" and i + 1 < len(options):
            found = options[i + 1]
        elif o.startswith("--search="):
            found = o.split("=", 1)[1]
    return found


def uses_beam(search: Optional[str]) -> bool:
    """Whether ``--beam`` means anything to the search (greedy and Jacobi ignore it)."""
    if search is None:
        return True
    import fairseq_stream  # noqa: F401  (registers the searches)
    from fairseq_stream.registry import SEARCH_REGISTRY

    return getattr(SEARCH_REGISTRY[search], "uses_beam", True)


def generate_command(args, model: dict, data_bin: str, extra: List[str], stats_file: Optional[str]) -> List[str]:
    """The fairseq-generate command line for one run (presets first, then typed options)."""
    from fairseq_stream.cli import plugin_dir

    src, tgt = args.pair.split("-")
    tool = os.path.join(os.path.dirname(sys.executable), "fairseq-generate")
    cmd = [tool, data_bin, "--path", ":".join(model["checkpoints"]), "--user-dir", plugin_dir(),
           "--preset", args.method, "--source-lang", src, "--target-lang", tgt, "--gen-subset", "test"]
    if args.gpu_memory:
        if args.beam not in (5, 50):
            raise NewstestError("--gpu-memory needs --beam 5 or 50 (the presets' settings), not {}".format(args.beam))
        cmd += ["--preset", "gpu{}gb-k{}".format(args.gpu_memory, args.beam)]
    if args.beam is not None:
        cmd += ["--beam", str(args.beam)]
    if args.batch_size is not None or not args.gpu_memory:
        cmd += ["--batch-size", str(args.batch_size or 32)]
    if args.cpu:
        cmd.append("--cpu")
    if stats_file:
        cmd += ["--stats-file", stats_file]
    return cmd + model["encoding"].generate_args() + extra


def device_name(cpu: bool) -> str:
    """``cpu`` or ``cuda: <GPU name>``, as fairseq-generate will decode."""
    import torch

    if cpu or not torch.cuda.is_available():
        return "cpu"
    return "cuda: " + torch.cuda.get_device_name()


def detokenized(stdout: str, count: int) -> List[str]:
    """fairseq-generate's D- lines in sentence order; every sentence exactly once."""
    hyps = {}
    for line in stdout.splitlines():
        if line.startswith("D-"):
            head, _, text = (line.split("\t", 2) + ["", ""])[:3]
            hyps[int(head[2:])] = text
    if sorted(hyps) != list(range(count)):
        raise NewstestError("fairseq-generate printed {} of {} translations".format(len(hyps), count))
    return [hyps[i] for i in range(count)]


def score(hyps: List[str], refs: List[str]):
    """sacreBLEU's corpus BLEU and its signature (default 13a tokenization, as WMT reports)."""
    from sacrebleu.metrics import BLEU

    bleu = BLEU()
    result = bleu.corpus_score(hyps, [refs])
    return round(result.score, 2), str(bleu.get_signature())


def decode_once(args, model, testset, data_bin, extra, run: int, device: str) -> dict:
    """One fairseq-generate run, scored: the results row."""
    search = preset_search(args.method)
    method = os.path.basename(args.method).replace(".args", "")  # a preset file's name, as a method's
    out_dir = os.path.join(args.work_dir, "out")
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "{}.{}.{}.k{}.run{}".format(testset.name, args.pair, method, args.beam or "", run))
    stats_file = stem + ".stats.json" if search else None
    cmd = generate_command(args, model, data_bin, extra, stats_file)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    with open(stem + ".log", "w", encoding="utf-8") as f:
        f.write(proc.stderr)
    with open(stem + ".out", "w", encoding="utf-8") as f:
        f.write(proc.stdout)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["exit {}".format(proc.returncode)])[-1]
        raise NewstestError("fairseq-generate failed (exit {}): {} (log: {}.log)".format(
            proc.returncode, last, stem))
    hyps = detokenized(proc.stdout, len(testset.source))
    with open(stem + ".hyp", "w", encoding="utf-8") as f:
        f.write("".join(h + "\n" for h in hyps))
    bleu, signature = score(hyps, testset.reference)
    translated = TRANSLATED.search(proc.stderr)
    counters = None
    if stats_file and os.path.exists(stats_file):
        with open(stats_file) as f:
            counters = {k: v for k, v in json.load(f).items() if k != "steps"}
    return {
        "pair": args.pair, "testset": testset.name, "method": method,
        "beam": args.beam if uses_beam(search) else None,
        "bleu": bleu, "bleu_signature": signature, "sentences": len(hyps),
        "words": sum(len(h.split()) for h in hyps),
        "wall_s": round(wall, 3), "decode_s": float(translated.group(3)) if translated else None,
        "counters": counters, "device": device, "preset": [args.method],
        "generate_args": [os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd)],
        "models": model["checkpoints"], "source": testset.origin,
        "host": socket.gethostname(), "threads": os.environ.get("OMP_NUM_THREADS"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "run": run,
        "hypotheses": stem + ".hyp", "grid": args.grid,
    }


def append_row(path: str, row: dict):
    """Append one JSON line (created with its directory if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


def summary_line(row: dict) -> str:
    """What one run printed for the user."""
    c = row["counters"] or {}
    extra = ", {} timesteps, {:.1f} expansions/step".format(c["timesteps"], c["expansions_per_step"]) if c else ""
    return "{} {} {}{}: BLEU {:.2f}, decoding {} s, whole run {:.1f} s{}".format(
        row["testset"], row["pair"], row["method"], " k={}".format(row["beam"]) if row["beam"] else "",
        row["bleu"], row["decode_s"], row["wall_s"], extra)


# A language pair as newstest.sh and newstest_all.sh take it: SRC-TGT codes.
PAIR = re.compile(r"[a-z]{2,3}-[a-z]{2,3}")


def run(argv: List[str]) -> List[dict]:
    """Parse ``argv``, prepare once, decode ``--runs`` times; return the rows appended."""
    ours, extra = split_argv(argv)
    args = parser().parse_args(ours)
    if not PAIR.fullmatch(args.pair):
        raise NewstestError("PAIR {!r}: give SRC-TGT language codes, e.g. de-en".format(args.pair))
    for option, value in (("--runs", args.runs), ("--limit", args.limit), ("--beam", args.beam),
                          ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise NewstestError("{} must be at least 1, got {}".format(option, value))
    if args.method not in methods() and not os.path.isfile(args.method):
        raise NewstestError("unknown METHOD {!r} (choose from: {}, or a preset file)".format(
            args.method, ", ".join(methods())))
    model = resolve_model(args)
    testset = ts.load(args.pair, args.year, args.text_dir, args.source, args.reference)
    if args.limit:
        testset.source, testset.reference = testset.source[:args.limit], testset.reference[:args.limit]
    data_bin = prep.prepare(testset, args.pair, model["encoding"], model["srcdict"], model["tgtdict"], args.work_dir)
    device = device_name(args.cpu or "--cpu" in extra)
    rows = []
    for i in range(1, args.runs + 1):
        row = decode_once(args, model, testset, data_bin, extra, i, device)
        append_row(args.results, row)
        print(summary_line(row), flush=True)
        rows.append(row)
    return rows


def main(argv: Optional[List[str]] = None):
    """Console entry: one-line errors, exit 1."""
    exit_on_signals()
    try:
        run(sys.argv[1:] if argv is None else argv)
    except NewstestError as e:
        sys.exit("{}: {}".format(PROG, e))


if __name__ == "__main__":
    main()
