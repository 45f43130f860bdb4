"""scripts/make_wmt19_standin.py: a WMT'19-shaped ensemble that fairseq and the plugin load like the real one.

The stand-ins built here are --tiny (same pipeline and architecture name,
small dimensions); the full-size architecture is checked from its training
arguments and a weightless (meta-device) build. The text is the first 30
lines of newstest2016-2018, committed under tests/data/wmt.
"""

import importlib.util
import io
import json
import os
import sys

import pytest
import torch

from conftest import REPO, run_tool

SCRIPT = REPO / "scripts" / "make_wmt19_standin.py"
DATA = REPO / "tests" / "data" / "wmt"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_wmt19_standin", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standin = _load_script()


def texts(pair, year, *langs):
    """Paths of the committed newstest sample of ``pair`` for ``year``, one per language."""
    return [str(DATA / pair / "newstest{}.{}".format(year, lang)) for lang in langs]


def build(out, *argv):
    """Run the script's main in this process (fairseq is imported once for all tests)."""
    return standin.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def de_en(tmp_path_factory):
    """A tiny de-en stand-in: joined dictionary, two float32 models."""
    out = tmp_path_factory.mktemp("standin") / "wmt19.de-en"
    argv = ["de-en", out, "--tiny", "--models", "2", "--train-text"] + texts("de-en", 2016, "de", "en")
    build(out, *argv)
    return out


@pytest.fixture(scope="module")
def ru_en(tmp_path_factory):
    """A tiny ru-en stand-in: separate dictionaries of two sizes, one float16 model."""
    out = tmp_path_factory.mktemp("standin") / "wmt19.ru-en"
    argv = ["ru-en", out, "--tiny", "--models", "1", "--fp16", "--dict-size", "1024", "1032",
            "--train-text"] + texts("ru-en", 2016, "ru", "en")
    build(out, *argv)
    return out, [str(a) for a in argv]


def load_dict(path):
    from fairseq.data import Dictionary

    return Dictionary.load(str(path))


def tokenized_sample(pair, langs, years):
    """The committed sample text after fairseq's Moses tokenizer."""
    tokenized = []
    for year in years:
        for path in texts(pair, year, *langs):
            lang = path.rsplit(".", 1)[1]
            with open(path, encoding="utf-8") as f:
                tokenized += standin.moses_tokenize(f.read().splitlines(), lang)
    return tokenized


# --- defaults and the full-size architecture (no weights built) -------------


def test_defaults_follow_the_released_ensembles():
    de = standin.parse_args(["de-en", "OUT", "--train-text", "x.de"])
    assert (de.models, de.joined, de.dict_size, de.bpe_merges, de.fp16) == (4, True, [42024, 42024], 32000, False)
    ru = standin.parse_args(["ru-en", "OUT", "--train-text", "x.ru"])
    assert (ru.models, ru.joined, ru.dict_size) == (4, False, [31640, 31232])
    assert standin.parse_args(["en-ru", "OUT", "--train-text", "x.en"]).dict_size == [31232, 31640]
    other = standin.parse_args(["fr-en", "OUT", "--train-text", "x.fr"])
    assert (other.joined, other.dict_size) == (False, [32000, 32000])
    tiny = standin.parse_args(["de-en", "OUT", "--tiny", "--train-text", "x.de"])
    assert (tiny.dict_size, tiny.bpe_merges, tiny.models) == ([2048, 2048], 2000, 4)
    assert standin.parse_args(["de-en", "OUT", "--separate", "--train-text", "x.de"]).joined is False
    joined_ru = standin.parse_args(["ru-en", "OUT", "--joined", "--train-text", "x.ru"])
    assert joined_ru.joined and joined_ru.dict_size == [31640, 31640]


@pytest.mark.parametrize("pair,params", [("de-en", 320_102_400), ("ru-en", 341_450_752)])
def test_full_size_architecture_is_the_wmt19_big_transformer(pair, params):
    opts = standin.parse_args([pair, "OUT", "--train-text", "x.en"])
    args = standin.training_namespace(opts, "DATA", seed=3)
    assert args.arch == "transformer_wmt_en_de_big" and args.task == "translation"
    assert (args.source_lang, args.target_lang, args.seed) == (pair[:2], "en", 3)
    assert (args.encoder_layers, args.decoder_layers) == (6, 6)
    assert (args.encoder_embed_dim, args.decoder_embed_dim) == (1024, 1024)
    assert (args.encoder_ffn_embed_dim, args.decoder_ffn_embed_dim) == (8192, 8192)
    assert (args.encoder_attention_heads, args.decoder_attention_heads) == (16, 16)
    joined = pair == "de-en"
    assert bool(args.share_all_embeddings) is joined
    assert bool(args.share_decoder_input_output_embed) is not joined
    # The parameter count of the real shapes, from a build that allocates no weights.
    dicts = [standin.build_dictionary([], size) for size in opts.dict_size]
    with torch.device("meta"):
        model = standin.build_model(args, *dicts)
    assert standin.count_parameters(model) == params
    assert model.encoder.embed_tokens.weight.shape == (opts.dict_size[0], 1024)
    assert model.decoder.output_projection.weight.shape == (opts.dict_size[1], 1024)


def test_tiny_keeps_the_architecture_name_with_small_dimensions():
    opts = standin.parse_args(["de-en", "OUT", "--tiny", "--train-text", "x.de"])
    args = standin.training_namespace(opts, "DATA", seed=1)
    assert args.arch == "transformer_wmt_en_de_big"
    assert (args.encoder_layers, args.encoder_embed_dim, args.encoder_ffn_embed_dim,
            args.encoder_attention_heads) == (2, 64, 128, 4)


# --- what a build writes ------------------------------------------------------


def test_layout_is_the_archives(de_en, ru_en):
    assert sorted(os.listdir(de_en)) == ["bpecodes", "dict.de.txt", "dict.en.txt", "model1.pt", "model2.pt",
                                         "standin.json"]
    assert sorted(os.listdir(ru_en[0])) == ["bpecodes", "dict.en.txt", "dict.ru.txt", "model1.pt", "standin.json"]
    record = json.loads((de_en / "standin.json").read_text())
    assert record["settings"]["pair"] == "de-en" and record["settings"]["models"] == 2
    assert record["files"]["model1.pt"] == (de_en / "model1.pt").stat().st_size


def test_joined_dictionary_is_one_dictionary_of_the_bpe_text(de_en):
    assert (de_en / "dict.de.txt").read_bytes() == (de_en / "dict.en.txt").read_bytes()
    d = load_dict(de_en / "dict.de.txt")
    assert len(d) == 2048
    real = [i for i in range(d.nspecial, len(d)) if not d[i].startswith("<standin_")]
    fillers = [i for i in range(d.nspecial, len(d)) if d[i].startswith("<standin_")]
    assert real and fillers and max(real) < min(fillers)  # real symbols first, fillers pad the rest
    assert all(d.count[i] == 0 for i in fillers) and all(d.count[i] > 0 for i in real)
    assert [d.count[i] for i in real] == sorted((d.count[i] for i in real), reverse=True)
    # Every symbol of the BPE'd training text of both languages has its own entry.
    tokenized = tokenized_sample("de-en", ("de", "en"), [2016])
    bpe = standin.apply_codes(str(de_en / "bpecodes"), tokenized)
    assert all(d.index(tok) != d.unk() for line in bpe for tok in line.split())


def test_separate_dictionaries_have_their_own_sizes_and_symbols(ru_en):
    out = ru_en[0]
    ru, en = load_dict(out / "dict.ru.txt"), load_dict(out / "dict.en.txt")
    assert (len(ru), len(en)) == (1024, 1032)
    assert ru.index("в") != ru.unk() and en.index("в") == en.unk()
    assert en.index("the") != en.unk()


def test_codes_are_fastbpe_format(de_en):
    lines = (de_en / "bpecodes").read_text(encoding="utf-8").splitlines()
    record = json.loads((de_en / "standin.json").read_text())
    assert 0 < len(lines) == record["result"]["merges"] <= 2000
    for line in lines:
        a, b, count = line.split(" ")  # exactly three columns, no '#version' header
        assert a and b and int(count) >= 2  # subword-nmt merges only pairs seen twice


def test_fastbpe_applies_the_codes_as_subword_nmt_does(de_en):
    """fairseq's --bpe fastbpe and subword-nmt's apply_bpe split the sample text identically.

    Compared token by token: subword-nmt keeps a trailing space that Moses
    sometimes leaves (after a final ``&apos;``), fastBPE drops it, and fairseq
    splits on whitespace either way.
    """
    from argparse import Namespace

    from fairseq.data import encoders
    from subword_nmt.apply_bpe import BPE

    codes = (de_en / "bpecodes").read_text(encoding="utf-8").splitlines()
    # subword-nmt reads its own format: the version header, two columns
    reference = BPE(io.StringIO("#version: 0.2\n" + "".join(" ".join(c.split(" ")[:2]) + "\n" for c in codes)))
    fairseq_bpe = encoders.build_bpe(Namespace(bpe="fastbpe", bpe_codes=str(de_en / "bpecodes")))
    tokenized = tokenized_sample("de-en", ("de", "en"), [2016, 2017, 2018])
    assert len(tokenized) == 180
    ours = [fairseq_bpe.encode(line).split() for line in tokenized]
    theirs = [reference.process_line(line).split() for line in tokenized]
    assert ours == theirs
    assert sum("@@" in tok for line in ours for tok in line) > 100  # the codes do split words


def test_models_are_legacy_checkpoints_from_different_seeds(de_en, ru_en):
    from fairseq_stream.checkpoint import load_state

    one, two = (load_state(str(de_en / "model{}.pt".format(i))) for i in (1, 2))
    for i, state in enumerate((one, two), start=1):
        assert "cfg" not in state and state["optimizer_history"][-1]["num_updates"] == 0
        args = state["args"]
        assert (args.arch, args.task, args.source_lang, args.target_lang) == (
            "transformer_wmt_en_de_big", "translation", "de", "en")
        assert args.share_all_embeddings and args.seed == i and args.data == str(de_en)
    weight = "encoder.layers.0.fc1.weight"
    assert one["model"][weight].dtype == torch.float32
    assert not torch.equal(one["model"][weight], two["model"][weight])
    # tied embeddings are one tensor on disk, as in a real checkpoint
    embeddings = [one["model"][k + ".weight"] for k in ("encoder.embed_tokens", "decoder.embed_tokens")]
    assert embeddings[0].data_ptr() == embeddings[1].data_ptr()
    ru = load_state(str(ru_en[0] / "model1.pt"))
    assert ru["model"][weight].dtype == torch.float16
    assert ru["args"].share_decoder_input_output_embed and not ru["args"].share_all_embeddings


def test_fairseq_loads_the_ensemble_through_the_plugin_and_decodes(de_en):
    import fairseq_stream  # noqa: F401  (safe checkpoint loading)
    from fairseq import checkpoint_utils

    from fairseq_stream.api import Translator

    paths = [str(de_en / "model1.pt"), str(de_en / "model2.pt")]
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(paths)
    assert len(models) == 2 and cfg.model.encoder_ffn_embed_dim == 128
    assert len(task.source_dictionary) == len(task.target_dictionary) == 2048

    translator = Translator(paths, search="var-stream", beam=5, cpu=True, tokenizer="moses", bpe="fastbpe",
                            bpe_codes=str(de_en / "bpecodes"), max_len_a=0, max_len_b=5)
    with open(texts("de-en", 2017, "de")[0], encoding="utf-8") as f:
        sources = f.read().splitlines()[:6]
    results = sorted(translator.translate(sources), key=lambda t: t.index)
    assert [t.index for t in results] == list(range(6))
    assert all(t.text.strip() and 1 <= len(t.hypotheses[0]["tokens"]) <= 6 for t in results)
    # the source went through Moses and fastBPE into known symbols, not <unk>s
    encoded = translator.encode(sources[0])
    assert (encoded != task.source_dictionary.unk()).float().mean() > 0.5


# --- re-runs and bad input ----------------------------------------------------


def test_a_second_run_with_the_same_settings_does_nothing(ru_en):
    out, argv = ru_en
    before = {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)}
    proc = run_tool([sys.executable, SCRIPT] + argv)
    assert proc.stdout.count("\n") == 1 and "already built" in proc.stdout
    assert "1 models x" in proc.stdout and "parameters" in proc.stdout
    assert {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)} == before


def test_changed_settings_rebuild_and_drop_stale_models(tmp_path, capsys):
    out = tmp_path / "s"
    base = ["de-en", out, "--tiny", "--bpe-merges", "100", "--dict-size", "512", "--train-text"] + texts(
        "de-en", 2018, "de", "en")
    build(out, *base, "--models", "2")
    first = (out / "model1.pt").read_bytes()
    build(out, *base, "--models", "1", "--seed", "7")
    assert sorted(os.listdir(out)) == ["bpecodes", "dict.de.txt", "dict.en.txt", "model1.pt", "standin.json"]
    assert (out / "model1.pt").read_bytes() != first  # seed 7, not 1
    assert json.loads((out / "standin.json").read_text())["settings"]["seed"] == 7
    capsys.readouterr()
    build(out, *base, "--models", "1", "--seed", "7", "--force")
    assert "built in" in capsys.readouterr().out


def test_a_directory_that_is_not_a_standin_is_not_overwritten(tmp_path):
    (tmp_path / "model1.pt").write_bytes(b"the real thing")
    argv = ["de-en", tmp_path, "--tiny", "--train-text"] + texts("de-en", 2018, "de", "en")
    with pytest.raises(SystemExit, match="no standin.json.*--force"):
        build(tmp_path, *argv)
    assert (tmp_path / "model1.pt").read_bytes() == b"the real thing"


@pytest.mark.parametrize("argv,message", [
    (["de-en", "OUT", "--train-text", "missing.de"], "text file missing.de does not exist"),
    (["de-en", "OUT", "--train-text", "notes.txt"], "cannot tell the language of notes.txt"),
    (["de-de", "OUT", "--train-text", "x.de"], "PAIR must be SRC-TGT"),
    (["ru-en", "OUT", "--joined", "--dict-size", "8", "16", "--train-text", "x.ru"], "joined dictionary has one size"),
    (["de-en", "OUT", "--train-updates", "5", "--train-text", "x.de"], "--train-updates needs parallel text"),
    (["de-en", "OUT", "--models", "0", "--train-text", "x.de"], "--models must be at least 1"),
])
def test_bad_input_stops_with_one_line(argv, message, tmp_path):
    argv = [str(tmp_path / "OUT") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit) as err:
        standin.main(argv)
    assert str(err.value).startswith("make_wmt19_standin: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_command_line_error_is_one_line_on_stderr(tmp_path):
    proc = run_tool([sys.executable, SCRIPT, "de-en", tmp_path / "o", "--train-text", tmp_path / "none.de"],
                    check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr


def test_a_default_dictionary_grows_to_hold_the_text(tmp_path, monkeypatch, capsys):
    """The README's --tiny command on four years of newstest needs 2205 symbols: the default size grows.

    The same situation on the committed sample: a default smaller than the
    text's symbols. A typed --dict-size stays a hard limit.
    """
    monkeypatch.setattr(standin, "TINY_DICT_SIZE", 64)
    text = texts("de-en", 2016, "de", "en")
    out = tmp_path / "grown"
    record = build(out, "de-en", out, "--tiny", "--models", "1", "--bpe-merges", "100", "--train-text", *text)
    d = load_dict(out / "dict.de.txt")
    assert len(d) > 64 and record["result"]["dict_size"] == [len(d), len(d)]
    assert not any(d[i].startswith("<standin_") for i in range(len(d)))  # every entry is a symbol of the text
    assert "more than the default 64-entry dictionary holds" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="more than a 64-entry dictionary holds; use a larger --dict-size"):
        build(out, "de-en", tmp_path / "typed", "--tiny", "--models", "1", "--bpe-merges", "100",
              "--dict-size", "64", "--train-text", *text)


@pytest.mark.parametrize("where", ["under a file", "bpecodes is a directory"])
def test_an_unwritable_out_dir_stops_with_one_line(tmp_path, where):
    """A path that cannot be created or written: one line naming it, exit status 1, no traceback."""
    if where == "under a file":
        (tmp_path / "file").write_text("x")
        out, culprit = tmp_path / "file" / "standin", tmp_path / "file" / "standin"
    else:
        out = tmp_path / "standin"
        (out / "bpecodes").mkdir(parents=True)
        (out / "standin.json").write_text("{}")  # a stand-in's directory, so no --force is needed
        culprit = out / "bpecodes"
    argv = ["de-en", out, "--tiny", "--models", "1", "--bpe-merges", "50", "--dict-size", "512",
            "--train-text"] + texts("de-en", 2016, "de", "en")
    with pytest.raises(SystemExit) as err:
        build(out, *argv)
    message = str(err.value)
    assert message.startswith("make_wmt19_standin: cannot write {}: ".format(culprit)) and "\n" not in message


def test_text_from_a_text_only_build_gives_the_same_standin(tmp_path):
    """--text-only on one machine, --text-from on another: the files of a build that learned its codes."""
    import torch

    text = texts("de-en", 2016, "de", "en")
    common = ["--tiny", "--models", "1", "--bpe-merges", "100", "--dict-size", "512", "--train-text"] + text
    only = build(tmp_path / "t", "de-en", tmp_path / "t", "--text-only", *common)
    assert sorted(only["files"]) == ["bpecodes", "dict.de.txt", "dict.en.txt"]
    build(tmp_path / "a", "de-en", tmp_path / "a", "--text-from", tmp_path / "t", *common)
    build(tmp_path / "b", "de-en", tmp_path / "b", *common)
    for name in ("bpecodes", "dict.de.txt", "dict.en.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    a, b = (torch.load(tmp_path / d / "model1.pt", weights_only=False)["model"] for d in "ab")
    assert all(torch.equal(a[k], b[k]) for k in b)
    with pytest.raises(SystemExit, match="not a build of the same text settings"):
        build(tmp_path / "c", "de-en", tmp_path / "c", "--text-from", tmp_path / "t", *common[:-3],
              "--train-text", *texts("de-en", 2018, "de", "en"))
