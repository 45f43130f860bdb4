#!/usr/bin/env python3
"""Build a stand-in for fairseq's WMT'19 ensembles: same layout, same architecture, synthetic weights.

fairseq's WMT'19 news translation ensembles (wmt19.de-en.joined-dict.ensemble
and wmt19.ru-en.ensemble from dl.fbaipublicfiles.com, see fairseq's
examples/wmt19/README.md) unpack to a directory holding

    model1.pt .. model4.pt   transformer_wmt_en_de_big with FFN 8192
                             (6+6 layers, 1024 dims, 16 heads)
    dict.SRC.txt dict.en.txt fairseq dictionaries of the BPE'd text
    bpecodes                 fastBPE codes, applied after Moses tokenization

This script writes a directory with exactly that layout, for timing decoding
at the real size and for testing the preprocessing chain (Moses -> fastBPE ->
dictionary) where the real archives cannot be downloaded:

* ``bpecodes``: BPE merges learned with subword-nmt on the Moses-tokenized
  ``--train-text`` files (both languages, one joint set of codes, as the
  archives ship one ``bpecodes``), written in fastBPE's ``a b count`` format;
* ``dict.SRC.txt`` / ``dict.TGT.txt``: fairseq dictionaries of that text
  after fastBPE, padded with count-0 filler symbols (``<standin_00000>`` ...)
  to the real models' sizes; one joined dictionary written twice for de-en
  (``--share-all-embeddings``), separate ones for ru-en
  (``--share-decoder-input-output-embed``);
* ``model1.pt`` .. ``modelN.pt``: real fairseq checkpoints in the legacy
  argparse format the released WMT'19 checkpoints use (``args`` Namespace +
  ``model`` state dict), each initialised from its own seed; untrained unless
  ``--train-updates``/``--train-seconds`` trains them briefly (``--member-noise``: model1 only, the
  others derived from it by seeded noise);
* ``standin.json``: the settings and sizes, written last; a later run with
  the same settings finds it and does nothing (``--force`` rebuilds).

Untrained weights translate into junk, but every matrix has the real shape,
so decoding speed and memory are the real ensemble's (up to how long the
junk hypotheses run; use ``--max-len-a``/``--max-len-b`` to bound them).

The text goes through fairseq's own Moses tokenizer class with its defaults
(aggressive dash splits, and HTML escaping: ``'`` -> ``&apos;``, as Moses'
tokenizer.perl does and as ``fairseq-generate --tokenizer moses`` does), so
the codes and dictionaries fit what fairseq makes of raw input.

Example (full size: 320M parameters, 1.28 GB per float32 model, 5.1 GB in
all; about 2.5 minutes on one core, half of it learning the 32000 merges):

    python scripts/make_wmt19_standin.py de-en /data/wmt19.de-en \\
        --train-text newstest201{3,4,5,6}.{de,en}
    scripts/newstest.sh de-en 2017 var-stream --models /data/wmt19.de-en --text-dir DIR --limit 10 \\
        -- --max-len-a 1.2 --max-len-b 10
    # or by hand: newstest2017.de -> Moses -> fastBPE -> test.de, then as for the real archive:
    fairseq-preprocess -s de -t en --only-source --testpref test --destdir BIN \\
        --srcdict /data/wmt19.de-en/dict.de.txt
    cp /data/wmt19.de-en/dict.en.txt BIN/
    fairseq-generate BIN -s de -t en --user-dir fairseq_stream --search var-stream --beam 5 \\
        --path /data/wmt19.de-en/model1.pt:/data/wmt19.de-en/model2.pt:... \\
        --tokenizer moses --bpe fastbpe --bpe-codes /data/wmt19.de-en/bpecodes
"""

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

PROG = "make_wmt19_standin"
FORMAT = 1  # bump when the files written for the same settings change

# Embedding rows (len(fairseq Dictionary): 4 special symbols + the file's
# lines) of the released models, as published in the HuggingFace FSMT ports
# of these checkpoints (facebook/wmt19-*), recalled rather than read from the
# archives: treat them as approximate. The archives' names say which pairs
# have a joined dictionary. Pairs not listed here default to separate
# dictionaries of OTHER_PAIR_DICT_SIZE entries.
KNOWN_PAIRS = {
    "de-en": {"joined": True, "dict_size": (42024, 42024)},
    "en-de": {"joined": True, "dict_size": (42024, 42024)},
    "ru-en": {"joined": False, "dict_size": (31640, 31232)},
    "en-ru": {"joined": False, "dict_size": (31232, 31640)},
}
OTHER_PAIR_DICT_SIZE = 32000
# The WMT'19 submission used 32K joint merges for En-De; the same default
# for every pair keeps one rule (the text may yield fewer merges).
FULL_MERGES = 32000
# --tiny: small enough to build, load and decode in a second or two.
TINY_MERGES = 2000
TINY_DICT_SIZE = 2048

# transformer_wmt_en_de_big already gives 6+6 layers, 1024 dims and 16 heads;
# the WMT'19 models widen its FFN from 4096 to 8192.
FULL_ARCH_ARGS = ["--encoder-ffn-embed-dim", "8192", "--decoder-ffn-embed-dim", "8192"]
# --tiny keeps the architecture name, so checkpoints load along the same path.
TINY_ARCH_ARGS = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
]
ARCH = "transformer_wmt_en_de_big"
FILLER = "<standin_{:05d}>"
# The training recipe of fairseq's big WMT transformers (examples/scaling_nmt),
# recorded in each checkpoint's args as a real training run would record it,
# and used as such by --train-updates.
TRAINING_ARGS = [
    "--task", "translation", "--arch", ARCH,
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
    "--lr", "0.0005", "--lr-scheduler", "inverse_sqrt", "--warmup-init-lr", "1e-07",
    "--dropout", "0.3", "--weight-decay", "0.0",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "3584",
]
FULL_WARMUP = 4000
# --train-seconds does not know its update count in advance: a short warm-up that a GPU passes in
# seconds, long enough that the big transformer's post-norm layers do not diverge at the recipe's rate.
TIMED_WARMUP = 200
TIMED_UPDATE_CAP = 10 ** 7


def fail(message):
    """Stop with a one-line error."""
    raise SystemExit("{}: {}".format(PROG, message))


def note(message):
    """Progress on stderr, so that stdout carries only the summary line."""
    print("{}: {}".format(PROG, message), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# command line


def parse_args(argv=None):
    """The command line, checked, with per-pair defaults filled in."""
    parser = argparse.ArgumentParser(
        prog="make_wmt19_standin.py",
        description=__doc__,
        epilog=textwrap.fill(
            "Default dictionary sizes (entries incl. fairseq's 4 special symbols, i.e. embedding rows; "
            "approximate: recalled from the HuggingFace FSMT ports of the released models, not read "
            "from the archives): de-en and en-de joined 42024; ru-en 31640 (ru) and 31232 (en); other "
            "pairs separate, {} each. --tiny: {} merges, {} entries. Full size: 320.1M parameters "
            "per de-en model, 1.28 GB on disk in float32 (5.1 GB for 4); 341.5M and 1.37 GB per "
            "ru-en model; --fp16 halves the sizes.".format(OTHER_PAIR_DICT_SIZE, TINY_MERGES, TINY_DICT_SIZE),
            width=79, break_on_hyphens=False),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("pair", metavar="PAIR",
                        help="language pair SRC-TGT, e.g. de-en or ru-en (any two language codes); "
                             "picks the joined/separate dictionaries and their default sizes")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created if missing)")
    parser.add_argument("--train-text", metavar="FILE", nargs="+", required=True,
                        help="raw text to learn the BPE codes and dictionaries from, in both languages; "
                             "each file's language is its extension (newstest2016.de -> de), "
                             "e.g. newstest201{3,4,5,6}.{de,en}")
    parser.add_argument("--bpe-merges", type=int, metavar="N",
                        help="BPE merge operations to learn (default {}, --tiny {}); "
                             "small text may yield fewer".format(FULL_MERGES, TINY_MERGES))
    parser.add_argument("--dict-size", type=int, nargs="+", metavar="N",
                        help="dictionary entries (incl. the 4 special symbols): one number for both "
                             "dictionaries, or SRC TGT for separate ones; text with more symbols is an "
                             "error (default: the real model's, see below, grown to hold every symbol "
                             "of text that needs more)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--joined", dest="joined", action="store_true", default=None,
                       help="one joined dictionary and --share-all-embeddings (default for de-en)")
    group.add_argument("--separate", dest="joined", action="store_false",
                       help="separate dictionaries and --share-decoder-input-output-embed "
                            "(default for ru-en and other pairs)")
    parser.add_argument("--models", type=int, default=4, metavar="N",
                        help="ensemble members model1.pt .. modelN.pt (default 4, as released)")
    parser.add_argument("--seed", type=int, default=1,
                        help="model I is initialised with seed SEED+I-1 (default 1)")
    parser.add_argument("--fp16", action="store_true",
                        help="save half-precision weights (default: float32)")
    parser.add_argument("--tiny", action="store_true",
                        help="same pipeline and architecture name, but 2+2 layers, 64 dims, FFN 128, "
                             "4 heads and small default merges/dictionaries: for tests")
    parser.add_argument("--train-updates", type=int, default=0, metavar="N",
                        help="train each model for N updates with fairseq-train from its seed "
                             "(default 0: untrained); needs --train-prefix; on a GPU when one is "
                             "visible (with --fp16 training), else on the CPU (practical with --tiny only)")
    parser.add_argument("--train-seconds", type=float, default=0, metavar="S",
                        help="train for at most S seconds (fairseq-train's --stop-time-hours; with "
                             "--train-updates, whichever ends first); needs --train-prefix")
    parser.add_argument("--member-noise", type=float, default=0, metavar="SIGMA",
                        help="train model1 only and make model2 .. modelN from its weights plus seeded "
                             "Gaussian noise of SIGMA times each tensor's standard deviation: distinct "
                             "members that behave like the trained one, for the cost of one training "
                             "(default 0: each member trains, or is initialised, from its own seed)")
    parser.add_argument("--train-prefix", metavar="PREFIX", nargs="+", default=[],
                        help="parallel text for --train-updates: PREFIX.SRC and PREFIX.TGT, "
                             "line by line translations (several prefixes are concatenated)")
    parser.add_argument("--text-only", action="store_true",
                        help="write bpecodes and the dictionaries (and standin.json) only, no models: "
                             "for --text-from on another machine (learning 32000 merges takes a minute)")
    parser.add_argument("--text-from", metavar="DIR",
                        help="copy bpecodes and the dictionaries from DIR (a --text-only or full build with the "
                             "same text settings and --train-text) instead of learning them again")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if OUT_DIR already holds this stand-in, and overwrite "
                             "files of the archive's names in a directory that is not a stand-in")
    opts = parser.parse_args(argv)
    return resolve(opts)


def resolve(opts):
    """Check the options and fill in the defaults that depend on PAIR and --tiny."""
    match = re.fullmatch(r"([a-z]{2,3})-([a-z]{2,3})", opts.pair)
    if not match or match.group(1) == match.group(2):
        fail("PAIR must be SRC-TGT with two different language codes, e.g. de-en (got {!r})".format(
            opts.pair))
    opts.src, opts.tgt = match.groups()
    known = KNOWN_PAIRS.get(opts.pair, {"joined": False, "dict_size": (OTHER_PAIR_DICT_SIZE,) * 2})
    if opts.joined is None:
        opts.joined = known["joined"]
    if opts.bpe_merges is None:
        opts.bpe_merges = TINY_MERGES if opts.tiny else FULL_MERGES
    # A default size is a floor: text with more symbols grows it (a typed --dict-size is a hard limit).
    opts.grow_dict = opts.dict_size is None
    if opts.dict_size is None:
        opts.dict_size = [TINY_DICT_SIZE] * 2 if opts.tiny else list(known["dict_size"])
        if opts.joined and opts.dict_size[0] != opts.dict_size[1]:
            opts.dict_size = [max(opts.dict_size)] * 2
    elif len(opts.dict_size) == 1:
        opts.dict_size = opts.dict_size * 2
    elif len(opts.dict_size) != 2:
        fail("--dict-size takes one number, or two (SRC TGT)")
    if opts.joined and opts.dict_size[0] != opts.dict_size[1]:
        fail("a joined dictionary has one size: give --dict-size one number")
    for name, value, least in (("--bpe-merges", opts.bpe_merges, 1), ("--models", opts.models, 1),
                               ("--dict-size", min(opts.dict_size), 5), ("--train-updates", opts.train_updates, 0),
                               ("--train-seconds", opts.train_seconds, 0), ("--member-noise", opts.member_noise, 0)):
        if value < least:
            fail("{} must be at least {} (got {})".format(name, least, value))
    opts.training = bool(opts.train_updates or opts.train_seconds)
    if opts.training and not opts.train_prefix:
        fail("--train-updates needs parallel text: --train-prefix PREFIX (PREFIX.{} and PREFIX.{})".format(
            opts.src, opts.tgt))
    if opts.train_prefix and not opts.training:
        fail("--train-prefix is only used with --train-updates N or --train-seconds S")
    return opts


def settings(opts):
    """What determines the files written, as recorded in standin.json (text by content, not by path)."""
    return {
        "format": FORMAT,
        "pair": opts.pair,
        "joined": opts.joined,
        "tiny": opts.tiny,
        "bpe_merges": opts.bpe_merges,
        "dict_size": list(opts.dict_size),
        "models": opts.models,
        "seed": opts.seed,
        "fp16": opts.fp16,
        "train_text": [file_digest(f) for f in opts.train_text],
        "text_only": opts.text_only,
        "train_updates": opts.train_updates,
        "train_seconds": opts.train_seconds,
        "member_noise": opts.member_noise,
        "train_prefix": [[file_digest(p + "." + lang) for lang in (opts.src, opts.tgt)]
                         for p in opts.train_prefix],
    }


# What bpecodes and the dictionaries depend on: --text-from reuses them where these match.
TEXT_SETTINGS = ("format", "pair", "joined", "tiny", "bpe_merges", "dict_size", "train_text")


def file_digest(path):
    """(file name, sha256 of its contents); a missing file is a one-line error."""
    if not os.path.isfile(path):
        fail("text file {} does not exist".format(path))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return [os.path.basename(path), digest.hexdigest()]


# ---------------------------------------------------------------------------
# text: Moses, BPE codes, dictionaries


def text_language(path, langs):
    """The language of a --train-text file: its extension, which must be one of the pair's."""
    lang = os.path.splitext(path)[1].lstrip(".")
    if lang not in langs:
        fail("cannot tell the language of {}: its extension must be .{} or .{}".format(path, *langs))
    return lang


def moses_tokenize(lines, lang):
    """Tokenize as ``fairseq-generate --tokenizer moses`` does (its own tokenizer class and defaults).

    Using fairseq's class rather than calling sacremoses directly keeps the
    options (aggressive dash splits, HTML escaping of quotes and apostrophes)
    whatever they are in this fairseq, so codes and dictionaries match what
    fairseq produces from raw input at decoding time.
    """
    from fairseq.data.encoders.moses_tokenizer import MosesTokenizer, MosesTokenizerConfig

    tokenizer = MosesTokenizer(MosesTokenizerConfig(source_lang=lang, target_lang=lang))
    return [tokenizer.encode(line.strip()) for line in lines]


def read_lines(path):
    """A text file's lines, without line ends."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except UnicodeDecodeError:
        fail("{} is not UTF-8 text".format(path))


def tokenized_text(files, langs):
    """{lang: Moses-tokenized lines of that language's files}; both languages must have text."""
    text = {lang: [] for lang in langs}
    for path in files:
        lang = text_language(path, langs)
        text[lang].extend(moses_tokenize(read_lines(path), lang))
    for lang, lines in text.items():
        if not any(line.strip() for line in lines):
            fail("no .{} text among --train-text (both languages are needed)".format(lang))
    return text


_MERGE_LOG = re.compile(r"pair \d+: (\S+) (\S+) -> \S+ \(frequency (\d+)\)")


def learn_codes(lines, merges):
    """BPE merges learned by subword-nmt on ``lines``, as (left, right, frequency) triples.

    subword-nmt writes only ``left right`` per merge, but fastBPE's codes
    format has a third column, the pair's frequency; subword-nmt reports it
    in its verbose log, so we read it from there (stderr is captured, which
    also keeps its progress bar off the terminal).
    """
    from subword_nmt.learn_bpe import learn_bpe

    codes, log = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(log):
        learn_bpe(lines, codes, merges, verbose=True)
    pairs = [tuple(line.split(" ")) for line in codes.getvalue().splitlines() if not line.startswith("#version")]
    logged = _MERGE_LOG.findall(log.getvalue())
    if [(a, b) for a, b, _ in logged] != pairs:
        fail("could not read the merge frequencies from subword-nmt's log (has its format changed?)")
    if not pairs:
        fail("no BPE merge could be learned from --train-text (no pair of symbols occurs twice)")
    return [(a, b, int(n)) for a, b, n in logged]


def write_codes(path, codes):
    """Write fastBPE's codes format: one ``left right frequency`` line per merge, no header."""
    with open(path, "w", encoding="utf-8") as f:
        for a, b, n in codes:
            f.write("{} {} {}\n".format(a, b, n))


def apply_codes(codes_path, lines):
    """``lines`` after fastBPE with these codes: what ``fairseq --bpe fastbpe`` feeds the model."""
    import fastBPE

    return fastBPE.fastBPE(codes_path).apply(lines)


def build_dictionary(bpe_lines, size, grow=False):
    """A fairseq Dictionary counted as fairseq-preprocess counts, padded to ``size`` entries.

    With ``grow``, text with more symbols than ``size`` holds gets a larger
    dictionary (every symbol, no filler) instead of an error: the default
    sizes are the real models', but ``--tiny``'s 2048 or the real sizes
    cannot know how much text the user brings.

    Symbols are counted and sorted as ``Dictionary.add_file_to_dictionary``
    and ``finalize`` do (by count, ties alphabetically; one ``</s>`` per
    line). Filler symbols with count 0 take the remaining slots, as
    fairseq's own ``madeupwordNNNN`` padding does, so the embedding matrix
    has the real model's number of rows.
    """
    from collections import Counter

    from fairseq.data import Dictionary
    from fairseq.tokenizer import tokenize_line

    dictionary = Dictionary()
    counts = Counter()
    for line in bpe_lines:
        counts.update(tokenize_line(line))
        counts[dictionary.eos_word] += 1
    for symbol, count in sorted(counts.items()):
        dictionary.add_symbol(symbol, count)
    dictionary.finalize(padding_factor=1)
    if len(dictionary) > size and grow:
        note("the BPE'd text has {} distinct symbols, more than the default {}-entry dictionary holds: "
             "the dictionary holds all of them ({} entries)".format(
                 len(dictionary) - dictionary.nspecial, size, len(dictionary)))
        size = len(dictionary)
    if len(dictionary) > size:
        fail("the BPE'd text has {} distinct symbols, more than a {}-entry dictionary holds; "
             "use a larger --dict-size or fewer --bpe-merges".format(len(dictionary) - dictionary.nspecial, size))
    for i in range(size - len(dictionary)):
        dictionary.add_symbol(FILLER.format(i), n=0)
    return dictionary


# ---------------------------------------------------------------------------
# models


def training_argv(opts, data, seed, warmup=FULL_WARMUP):
    """fairseq-train's command line (without the program name) for one ensemble member."""
    sharing = ["--share-all-embeddings"] if opts.joined else ["--share-decoder-input-output-embed"]
    return ([data, "--source-lang", opts.src, "--target-lang", opts.tgt] + TRAINING_ARGS
            + ["--warmup-updates", str(warmup), "--seed", str(seed)] + sharing
            + (TINY_ARCH_ARGS if opts.tiny else FULL_ARCH_ARGS))


def training_namespace(opts, data, seed, warmup=FULL_WARMUP):
    """The argparse Namespace fairseq-train makes of :func:`training_argv` (no weights are built)."""
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=training_argv(opts, data, seed, warmup))


def build_model(args, src_dict, tgt_dict):
    """The model fairseq-train would build from ``args`` before its first update (seeded as it seeds)."""
    import numpy as np
    from fairseq import utils
    from fairseq.tasks.translation import TranslationTask

    np.random.seed(args.seed)
    utils.set_torch_seed(args.seed)
    task = TranslationTask(args, src_dict, tgt_dict)
    # build_model also completes ``args`` (max positions ...) as it does in a training run
    return task.build_model(args)


def save_checkpoint(path, args, model, fp16, num_updates=0):
    """Save in the legacy (argparse) format of the released WMT'19 checkpoints.

    fairseq upgrades such files on load (``args`` -> ``cfg``) exactly as it
    upgrades the real ones. The state dict is taken from the model in its
    final dtype, so tied embeddings stay one tensor on disk. The file is
    written under a temporary name and renamed, so an interrupted build never
    leaves a truncated model behind a valid name.
    """
    import torch

    model = model.half() if fp16 else model.float()
    state = {
        "args": args,
        "model": model.state_dict(),
        "optimizer_history": [{
            "criterion_name": "LabelSmoothedCrossEntropyCriterion",
            "optimizer_name": "FairseqAdam",
            "lr_scheduler_state": {"best": None},
            "num_updates": num_updates,
        }],
        "extra_state": {"train_iterator": {"epoch": 1}, "val_loss": None},
        "last_optimizer_state": None,
    }
    tmp = path + ".tmp"
    try:
        torch.save(state, tmp)
    except RuntimeError as e:  # torch reports a file it cannot open or write (a full disk) as RuntimeError
        with contextlib.suppress(OSError):
            os.remove(tmp)
        fail("cannot write {}: {}".format(tmp, str(e).strip().splitlines()[-1] if str(e).strip() else e))
    os.replace(tmp, path)


def count_parameters(model):
    """Distinct parameters (tied embeddings counted once, as ``model.parameters()`` yields them)."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------
# --train-updates


def prepare_training_data(opts, out_dir, work):
    """Tokenize, BPE and binarize the --train-prefix text with the stand-in's codes and dictionaries."""
    langs = (opts.src, opts.tgt)
    sides = {lang: [] for lang in langs}
    for prefix in opts.train_prefix:
        lines = {lang: read_lines(prefix + "." + lang) for lang in langs}
        if len(lines[opts.src]) != len(lines[opts.tgt]):
            fail("{}.{} and {}.{} differ in length ({} and {} lines): --train-prefix needs parallel text".format(
                prefix, opts.src, prefix, opts.tgt, len(lines[opts.src]), len(lines[opts.tgt])))
        for lang in langs:
            sides[lang].extend(moses_tokenize(lines[lang], lang))
    codes = os.path.join(out_dir, "bpecodes")
    for lang in langs:
        with open(os.path.join(work, "train." + lang), "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in apply_codes(codes, sides[lang]))
    data_bin = os.path.join(work, "data-bin")
    run_fairseq("preprocess", [
        "--source-lang", opts.src, "--target-lang", opts.tgt, "--trainpref", os.path.join(work, "train"),
        "--destdir", data_bin, "--workers", "1",
        "--srcdict", os.path.join(out_dir, "dict.{}.txt".format(opts.src)),
        "--tgtdict", os.path.join(out_dir, "dict.{}.txt".format(opts.tgt)),
    ])
    return data_bin


def run_fairseq(tool, argv):
    """Run ``fairseq-TOOL`` in this interpreter; its log goes to stderr, a failure ends the build."""
    cmd = [sys.executable, "-m", "fairseq_cli." + tool] + argv
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        fail("fairseq-{} failed (exit {}): {}".format(tool, proc.returncode, " ".join(cmd)))


def train_model(opts, data_bin, work, seed):
    """Train one member (--train-updates updates, --train-seconds seconds, whichever ends first).

    Returns (its state dict, its updates, the warm-up used). A short run
    would never leave the real 4000-update warm-up, so the warm-up is
    shortened to a tenth of the run, or to ``TIMED_WARMUP`` for a run bounded
    by time only (and recorded as such).
    """
    import torch

    updates = opts.train_updates or TIMED_UPDATE_CAP
    warmup = min(FULL_WARMUP, max(1, updates // 10)) if opts.train_updates else TIMED_WARMUP
    save_dir = os.path.join(work, "checkpoints-{}".format(seed))
    device = ["--fp16"] if torch.cuda.is_available() else ["--cpu"]
    limit = ["--stop-time-hours", repr(opts.train_seconds / 3600)] if opts.train_seconds else []
    run_fairseq("train", training_argv(opts, data_bin, seed, warmup) + device + limit + [
        "--max-update", str(updates), "--save-dir", save_dir, "--disable-validation",
        "--no-epoch-checkpoints", "--no-save-optimizer-state", "--log-format", "simple",
        "--log-interval", str(max(1, min(updates, 1000) // 10)),
    ])
    # Our own fairseq-train run wrote this file moments ago: the full unpickler is safe here.
    state = torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=False)
    return state["model"], state["optimizer_history"][-1].get("num_updates", opts.train_updates), warmup


def perturb(model, sigma, seed):
    """Add seeded Gaussian noise of ``sigma`` times each parameter's standard deviation, in place.

    Parameters, not state-dict entries: tied embeddings are one parameter and
    stay tied.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype)
                       * (sigma * p.float().std()))


# ---------------------------------------------------------------------------
# the build


def layout(opts):
    """The files of the archive's layout, in the order they are written."""
    dicts = sorted({"dict.{}.txt".format(opts.src), "dict.{}.txt".format(opts.tgt)})
    models = [] if opts.text_only else ["model{}.pt".format(i) for i in range(1, opts.models + 1)]
    return ["bpecodes"] + dicts + models


def existing_record(out_dir):
    """standin.json's contents, or None where there is none (or it is unreadable)."""
    try:
        with open(os.path.join(out_dir, "standin.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_complete(out_dir, record, wanted):
    """Whether ``record`` describes a finished build with ``wanted`` settings whose files are all intact."""
    if not record or record.get("settings") != wanted:
        return False
    for name, size in record.get("files", {}).items():
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return False
    return bool(record.get("files"))


def clear_previous(out_dir, record, names, force):
    """Make OUT_DIR ready for a build: drop the old record first, and stale models of a smaller ensemble.

    Files of the archive's names in a directory that is not a stand-in (no
    standin.json), a real unpacked archive for instance, are overwritten only
    with --force.
    """
    present = [n for n in names if os.path.exists(os.path.join(out_dir, n))]
    if record is None and present and not force:
        fail("{} holds {} but no standin.json: not a stand-in of this script; pass --force to overwrite".format(
            out_dir, ", ".join(present)))
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, "standin.json"))
    for name in (record or {}).get("files", {}):
        if name not in names and re.fullmatch(r"model\d+\.pt", name):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))


def copy_text_files(opts, out_dir):
    """--text-from: bpecodes and the dictionaries of an earlier build with the same text settings."""
    import shutil

    from fairseq.data import Dictionary

    record, wanted = existing_record(opts.text_from) or {}, settings(opts)
    theirs = record.get("settings", {})
    if any(theirs.get(k) != wanted[k] for k in TEXT_SETTINGS):
        fail("--text-from {}: not a build of the same text settings ({}) and --train-text".format(
            opts.text_from, ", ".join(TEXT_SETTINGS[1:-1])))
    names = ["bpecodes"] + ["dict.{}.txt".format(lang) for lang in (opts.src, opts.tgt)]
    for name in names:
        shutil.copyfile(os.path.join(opts.text_from, name), os.path.join(out_dir, name))
    dicts = tuple(Dictionary.load(os.path.join(out_dir, n)) for n in names[1:])
    return dicts, record["result"]["merges"]


def write_text_files(opts, out_dir):
    """bpecodes and the dictionaries; returns the dictionaries (source, target)."""
    if opts.text_from:
        return copy_text_files(opts, out_dir)
    langs = (opts.src, opts.tgt)
    text = tokenized_text(opts.train_text, langs)
    note("learning {} BPE merges from {} lines".format(opts.bpe_merges, sum(map(len, text.values()))))
    codes = learn_codes([line for lang in langs for line in text[lang]], opts.bpe_merges)
    codes_path = os.path.join(out_dir, "bpecodes")
    write_codes(codes_path, codes)
    bpe = {lang: apply_codes(codes_path, text[lang]) for lang in langs}
    if opts.joined:
        joined = build_dictionary(bpe[opts.src] + bpe[opts.tgt], opts.dict_size[0], opts.grow_dict)
        dicts = (joined, joined)
    else:
        dicts = tuple(build_dictionary(bpe[lang], size, opts.grow_dict) for lang, size in zip(langs, opts.dict_size))
    for lang, dictionary in zip(langs, dicts):
        dictionary.save(os.path.join(out_dir, "dict.{}.txt".format(lang)))
    return dicts, len(codes)


def write_models(opts, out_dir, dicts):
    """model1.pt .. modelN.pt; returns the parameter count of one model."""
    # training binarizes its text and trains in a scratch directory
    work_ctx = tempfile.TemporaryDirectory(prefix="standin-train-") if opts.training else contextlib.nullcontext()
    with work_ctx as work:
        data_bin = prepare_training_data(opts, out_dir, work) if opts.training else None
        params, first = None, None
        for i in range(1, opts.models + 1):
            seed = opts.seed + i - 1
            derived = opts.member_noise and i > 1
            note("model{}.pt (seed {}{})".format(i, seed, ", model1 plus noise {}".format(opts.member_noise)
                                                  if derived else ", trained" if opts.training else ""))
            num_updates, warmup, trained = 0, FULL_WARMUP, None
            if derived:
                trained, num_updates, warmup = first
            elif opts.training:
                trained, num_updates, warmup = train_model(opts, data_bin, work, seed)
            # The checkpoint records the stand-in's directory as its data, as a
            # training run records the data-bin it read the dictionaries from.
            args = training_namespace(opts, os.path.abspath(out_dir), seed, warmup)
            if opts.training:
                args.max_update = num_updates
            model = build_model(args, *dicts)
            if trained is not None:
                model.load_state_dict(trained, strict=True)
            if derived:
                perturb(model, opts.member_noise, seed)
            elif opts.member_noise:
                first = (trained or model.state_dict(), num_updates, warmup)
            params = count_parameters(model)
            save_checkpoint(os.path.join(out_dir, "model{}.pt".format(i)), args, model, opts.fp16, num_updates)
            del model, trained
    return params


def summary_line(out_dir, record, skipped=False):
    """The one-line report (also for a build that was already there)."""
    res = record["result"]
    how = "already built (same settings; --force rebuilds)" if skipped else "built in {:.1f} s".format(
        res["seconds"])
    return ("{}: {} {} ({}, {} BPE merges, dict {}): {} models x {:,} parameters, {:,} bytes per model, "
            "{} in all, {}".format(
                PROG, out_dir, record["settings"]["pair"], res["arch"], res["merges"],
                "joined {}".format(res["dict_size"][0]) if record["settings"]["joined"]
                else "{} + {}".format(*res["dict_size"]),
                0 if record["settings"].get("text_only") else record["settings"]["models"], res["params"],
                res["bytes_per_model"],
                human_size(res["total_bytes"]), how))


def human_size(n):
    """Bytes in GB or MB (decimal units, as ``ls -h --si`` and download pages give them)."""
    return "{:.2f} GB".format(n / 1e9) if n >= 1e9 else "{:.1f} MB".format(n / 1e6)


def arch_description(opts):
    """e.g. ``transformer_wmt_en_de_big 6+6 layers, 1024 dims, FFN 8192, 16 heads``."""
    args = training_namespace(opts, "DATA", opts.seed)
    return "{} {}+{} layers, {} dims, FFN {}, {} heads".format(
        ARCH, args.encoder_layers, args.decoder_layers, args.encoder_embed_dim,
        args.encoder_ffn_embed_dim, args.encoder_attention_heads)


def build(opts):
    """Build the stand-in (or find it already built); return (record, whether it was skipped)."""
    start = time.time()
    out_dir = opts.out_dir
    wanted = settings(opts)
    record = existing_record(out_dir)
    if not opts.force and is_complete(out_dir, record, wanted):
        return record, True
    names = layout(opts)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        fail("{} exists and is not a directory".format(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    clear_previous(out_dir, record, names, opts.force)

    dicts, merges = write_text_files(opts, out_dir)
    params = 0 if opts.text_only else write_models(opts, out_dir, dicts)
    files = {name: os.path.getsize(os.path.join(out_dir, name)) for name in names}
    model_bytes = [files[n] for n in names if n.startswith("model")] or [0]
    record = {
        "settings": wanted,
        "result": {
            "arch": arch_description(opts),
            "merges": merges,
            "dict_size": [len(d) for d in dicts],
            "params": params,
            "bytes_per_model": max(model_bytes),
            "total_bytes": sum(files.values()),
            "seconds": round(time.time() - start, 1),
        },
        "files": files,
    }
    tmp = os.path.join(out_dir, "standin.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, "standin.json"))
    return record, False


def main(argv=None):
    """Build (or find) the stand-in, print the one-line summary and return standin.json's record."""
    opts = parse_args(argv)
    for path in opts.train_text:
        text_language(path, (opts.src, opts.tgt))
    try:
        record, skipped = build(opts)
    except OSError as e:  # OUT_DIR cannot be created or written (permissions, a file in the way, a full disk)
        fail("cannot write {}: {}".format(e.filename or opts.out_dir, e.strerror or e))
    print(summary_line(opts.out_dir, record, skipped), flush=True)
    return record


if __name__ == "__main__":
    main()
