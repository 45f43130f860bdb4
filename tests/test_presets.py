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


def test_help_lists_the_presets(capsys):
    with pytest.raises(SystemExit):
        parse_generate_args(["--user-dir", plugin_dir(), "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--preset NAME|FILE" in out and "var-stream" in out and "jacobi" in out


# The GPU presets only set --batch-size (plain fairseq beam search without a method preset).
# A typed --beam 5 keeps the k=50 presets quick on the toy model.
@pytest.mark.parametrize("name", [n for n in presets.names() if not n.startswith("gpu")])
def test_every_shipped_preset_decodes_every_sentence(toy, capsys, name):
    generate_in_process([toy.data_bin, "--path", toy.transformer, "--gen-subset", "test", "--batch-size", "8",
                         "--cpu", "--user-dir", plugin_dir(), "--preset", name, "--beam", "5"])
    assert sorted(hypotheses(capsys.readouterr().out)) == list(range(37))
