"""``--preset NAME|FILE``: expansion, precedence of typed options, errors, and every shipped preset run."""

import pytest

from conftest import generate_in_process, hypotheses, parse_generate_args, run_tool
from fairseq_stream import presets
from fairseq_stream.cli import plugin_dir


def test_presets_expand_first_in_the_order_given():
    argv = ["DATA", "--preset", "var-stream", "--beam", "5", "--preset=gpu32gb-k50"]
    assert presets.expand(argv) == (presets.options_of("var-stream") + presets.options_of("gpu32gb-k50")
                                    + ["DATA", "--beam", "5"])
    assert presets.expand(["DATA", "--beam", "5"]) == ["DATA", "--beam", "5"]


def test_typed_options_win_over_the_preset():
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir(), "--preset", "var-stream",
                                "--beam", "7", "--stream-eps", "1/3"])
    assert (args.search, args.beam, args.stream_eps) == ("var-stream", 7, "1/3")
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir(), "--preset", "var-stream"])
    assert (args.search, args.beam, args.stream_eps) == ("var-stream", 50, "1/6")
    # A typed --search replaces the preset's, and its generator options go with it.
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir(), "--preset", "fixed", "--search", "var-batch"])
    assert (args.search, args.beam) == ("var-batch", 5)


def test_a_file_preset_with_comments_and_quoting(tmp_path):
    f = tmp_path / "mine.args"
    f.write_text("# my settings\n--search var --prune-ap 2.5  # inline comment\n--beam '12'\n")
    assert presets.expand(["--preset", str(f), "DATA"]) == ["--search", "var", "--prune-ap", "2.5",
                                                            "--beam", "12", "DATA"]
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir(), "--preset", str(f)])
    assert (args.search, args.prune_ap, args.beam) == ("var", 2.5, 12)


def test_bad_presets_are_one_line_errors(tmp_path):
    with pytest.raises(presets.PresetError, match=r"no such file and no such preset \(presets: beam, "):
        presets.expand(["--preset", "nope"])
    with pytest.raises(presets.PresetError, match="needs a name or a file"):
        presets.expand(["DATA", "--preset"])
    nested = tmp_path / "nested.args"
    nested.write_text("--preset var-stream\n")
    with pytest.raises(presets.PresetError, match="cannot name another preset"):
        presets.expand(["--preset", str(nested)])
    # Through the command line: argparse's one-line usage error, no traceback.
    proc = run_tool(["fairseq-generate", "DATA", "--user-dir", plugin_dir(), "--preset", "nope"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("fairseq-generate: error: --preset 'nope': no such")


@pytest.mark.parametrize("content, says", [
    ("--search fixed\n--bogus-key 3\n", "unrecognized arguments: --bogus-key 3"),
    ("--search fixed --beam\n", "argument --beam: expected one argument"),
    ("foo\n", "unrecognized arguments: foo"),
])
def test_a_bad_entry_of_a_preset_file_is_named_not_the_data_directory(toy, tmp_path, capsys, content, says):
    """The presets' options went before the whole command line, so a stray word or an option without its value
    took the data directory ("unrecognized arguments: --bogus-key toy/data-bin")."""
    preset = tmp_path / "mine.args"
    preset.write_text(content)
    with pytest.raises(SystemExit):
        parse_generate_args([str(toy.data_bin), "--path", str(toy.transformer), "--user-dir", plugin_dir(),
                             "--cpu", "--preset", str(preset)])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: " + says)


def test_help_lists_the_presets(capsys):
    with pytest.raises(SystemExit):
        parse_generate_args(["--user-dir", plugin_dir(), "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--preset NAME|FILE" in out and "var-stream" in out and "jacobi" in out


# The GPU presets only set --batch-size (plain fairseq beam search without a method preset), and the CPU
# precision presets (cpu-int8, cpu-int16) are added to a search preset (tests/test_quantized_decoding.py).
# A typed --beam 5 keeps the k=50 presets quick on the toy model.
@pytest.mark.parametrize("name", presets.method_names())
def test_every_shipped_preset_decodes_every_sentence(toy, capsys, name):
    generate_in_process([toy.data_bin, "--path", toy.transformer, "--gen-subset", "test", "--batch-size", "8",
                         "--cpu", "--user-dir", plugin_dir(), "--preset", name, "--beam", "5"])
    assert sorted(hypotheses(capsys.readouterr().out)) == list(range(37))


# -- which file a value names (issue 32, item 6) ----------------------------------


def test_a_shipped_name_wins_over_a_file_of_that_name_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "greedy").write_text("--search beam\n")
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir(), "--preset", "greedy"])
    assert args.search == "greedy"
    # A value with a '/' (or ending in .args) is a path.
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir(), "--preset", "./greedy"])
    assert args.search == "beam"
    (tmp_path / "mine.args").write_text("--search var --beam 3\n")
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir(), "--preset", "mine.args"])
    assert (args.search, args.beam) == ("var", 3)
    (tmp_path / "mine").write_text("--search var\n")
    with pytest.raises(presets.PresetError, match=r"no such preset .*; for the file, give its path: --preset \./mine$"):
        presets.expand(["--preset", "mine"])
    with pytest.raises(presets.PresetError, match=r"'\./nope\.args': no such file"):
        presets.expand(["--preset", "./nope.args"])


# -- a typed --search or --generator replaces the preset's (issue 32, item 6) -------


@pytest.mark.parametrize("argv, expected, absent", [
    # The preset's jacobi options went to greedy's parser: "unrecognized arguments" naming DATA.
    (["--preset", "jacobi", "--search", "greedy"], dict(search="greedy", generator=None), ["jacobi_block"]),
    # Jacobi runs on batch only: the preset's top-up goes, with its threshold; its --beam 5 is ignored, and
    # set to 1 so that fairseq's BLEU line says what ran (issue 49, item 9).
    (["--preset", "topup", "--search", "jacobi"], dict(search="jacobi", generator=None, beam=1), ["topup_threshold"]),
    # var-stream brings its own generator: the preset's --generator stream would be refused.
    (["--preset", "fixed-stream", "--search", "var-stream"], dict(search="var-stream", generator=None, beam=50), []),
    (["--preset", "topup", "--generator", "stream"], dict(search="fixed", generator="stream", beam=5),
     ["topup_threshold"]),
    (["--preset", "var-stream", "--search", "fixed"], dict(search="fixed", generator=None, beam=50), ["stream_eps"]),
    # The same search typed again keeps every option of the preset.
    (["--preset", "jacobi", "--search", "jacobi", "--jacobi-block", "2"],
     dict(search="jacobi", jacobi_variant="hgj", jacobi_block=2), []),
])
def test_a_typed_search_or_generator_replaces_the_presets(argv, expected, absent):
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir()] + argv)
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.data == "DATA"
    for name in absent:
        assert not hasattr(args, name)


def test_preset_jacobi_with_a_typed_search_greedy_decodes_greedy(toy, capsys, caplog):
    common = [toy.data_bin, "--path", toy.transformer, "--gen-subset", "test", "--batch-size", "8", "--cpu",
              "--user-dir", plugin_dir()]
    generate_in_process(common + ["--search", "greedy"])
    greedy = hypotheses(capsys.readouterr().out)
    with caplog.at_level("INFO", logger="fairseq_stream.fairseq_glue"):
        generate_in_process(common + ["--preset", "jacobi", "--search", "greedy"])
    assert hypotheses(capsys.readouterr().out) == greedy
    assert ("the typed --search greedy replaces the preset's --search jacobi; left out the preset's options "
            "that only those took: --jacobi-variant hgj --jacobi-block 3 --jacobi-calibrate on") in caplog.text


# -- long presets (issue 32, item 8) ------------------------------------------------


def test_repeated_options_keep_their_last_value_only():
    from fairseq_stream.presets import Arity

    arity = {"--beam": Arity("beam", True), "--batch-size": Arity("batch_size", True),
             "--max-sentences": Arity("batch_size", True), "--cpu": Arity("cpu", False)}
    options = ["--beam", "5", "--cpu", "--max-sentences", "4", "--beam=7", "--odd", "x", "--batch-size", "6",
               "--cpu", "--odd", "y", "--beam", "--cpu"]
    # Aliases share their last value; unknown options and a value argparse would refuse pass unchanged.
    assert presets.last_of_each(options, arity) == ["--beam=7", "--odd", "x", "--batch-size", "6", "--odd", "y",
                                                    "--beam", "--cpu"]


def test_a_200000_line_preset_reaches_argparse_as_one_option_each(tmp_path, monkeypatch):
    """argparse's parsing is quadratic in the options given (10,000 preset lines took 57 s): only the
    last of each repeated option may reach it. Checked by what argparse is handed, not by a clock."""
    from fairseq_stream import fairseq_glue

    f = tmp_path / "long.args"
    lines = ["# line {}\n--beam {}\n--max-sentences {}\n--batch-size {}\n--cpu\n".format(i, i % 9 + 1, i % 5 + 1, i % 7 + 1)
             for i in range(40000)]
    f.write_text("".join(lines))
    assert sum(1 for _ in f.open()) == 200000
    handed = []
    expand = fairseq_glue.expand_presets
    monkeypatch.setattr(fairseq_glue, "expand_presets", lambda parser, argv: handed.append(expand(parser, argv))
                        or handed[-1])
    # (var: a search that keeps --beam; greedy's is set to 1.)
    args = parse_generate_args(["DATA", "--user-dir", plugin_dir(), "--preset", str(f), "--search", "var"])
    last = 39999
    assert (args.beam, args.batch_size, args.cpu) == (last % 9 + 1, last % 7 + 1, True)
    assert handed and max(len(argv) for argv in handed) < 20, handed
