"""The plugin as users run it: fairseq-generate / fairseq-interactive with --user-dir."""

import re
import sys

import pytest

from conftest import (REPO, generate_in_process, hypotheses, parse_generate_args, run_plain_fairseq_generate,
                      run_tool)
from fairseq_stream.cli import plugin_dir

GEN = ["fairseq-generate"]


def gen_args(toy, *extra, path=None):
    return [toy.data_bin, "--path", path or toy.transformer, "--gen-subset", "test",
            "--batch-size", "8", "--beam", "5", "--cpu"] + list(extra)


def help_text(capsys, *argv):
    """fairseq-generate's --help with the plugin, in-process."""
    with pytest.raises(SystemExit) as done:
        parse_generate_args(["--user-dir", plugin_dir()] + list(argv) + ["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_lists_search_and_generator(capsys):
    out = help_text(capsys)
    assert re.search(r"--search \{[^}]*beam", out)
    assert re.search(r"--generator \{[^}]*batch", out)
    assert "--trust-checkpoint" in out


@pytest.mark.parametrize("search, flags", [
    ("var", ("--prune-rp", "--prune-ap", "--prune-rpl", "--prune-mc", "--finalize", "--stats-file")),
    ("var-stream", ("--stream-eps", "--stream-pool", "--stream-max-wait", "--stream-max-cached", "--prune-ap")),
])
def test_options_of_the_chosen_search_appear_in_help(capsys, search, flags):
    out = help_text(capsys, "--search", search)
    for flag in flags:
        assert flag in out


def test_help_gives_each_option_its_default(capsys):
    """fairseq's parser prints no defaults: --stream-max-wait's help left its 64 unsaid."""
    out = " ".join(help_text(capsys, "--search", "var-stream").split())
    assert "(0: off) (default: 64)" in out
    assert re.search(r"--runner \{[^}]*\} model runner: .*?\(default: auto\)", out)
    # A help that already says its default says it once.
    assert "--stream-pool STREAM_POOL n, the most sentences decoded at once (default: --batch-size" in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_without_the_plugin_there_is_no_search_option():
    out = run_tool(GEN + ["--help"]).stdout
    assert "--search" not in out and "--generator" not in out


def test_unknown_search_is_a_one_line_error_naming_the_choices(toy, capsys):
    with pytest.raises(SystemExit) as done:
        parse_generate_args(gen_args(toy, "--user-dir", plugin_dir(), "--search", "nope"))
    assert done.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown --search nope (choose from: beam, fixed, greedy, jacobi, var, var-batch, var-stream)" in last


@pytest.mark.parametrize("extra", [["--search", "greedy"], ["--search", "var-stream"], ["--search", "beam"], []])
def test_unknown_generator_is_named_unknown_not_a_bad_combination(toy, capsys, extra):
    with pytest.raises(SystemExit) as done:
        parse_generate_args(gen_args(toy, "--user-dir", plugin_dir(), *extra, "--generator", "nosuch"))
    assert done.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("error: unknown --generator nosuch (choose from: batch, stream, fifo, topup)"), last


@pytest.mark.parametrize("model", ["transformer", "lstm"])
def test_search_beam_is_identical_to_plain_fairseq_generate(toy, model):
    # Plain fairseq drops the last batch unless the multiple is 1 (see below).
    args = gen_args(toy, "--required-batch-size-multiple", "1", path=getattr(toy, model))
    plain = run_plain_fairseq_generate(args).stdout
    ours = run_tool(GEN + args + ["--user-dir", "fairseq_stream", "--search", "beam"]).stdout
    pick = lambda out: sorted(l for l in out.splitlines() if l[:2] in ("S-", "T-", "H-", "D-", "P-"))
    assert len(hypotheses(plain)) == 37
    assert pick(ours) == pick(plain)


def test_plugin_without_search_leaves_fairseq_output_unchanged(toy):
    args = gen_args(toy, "--required-batch-size-multiple", "1")
    plain = hypotheses(run_plain_fairseq_generate(args).stdout)
    loaded = hypotheses(run_tool(GEN + args + ["--user-dir", "fairseq_stream"]).stdout)
    assert loaded == plain


@pytest.mark.parametrize("search", ["beam", "fixed"])
def test_every_sentence_comes_out_once_and_the_counts_are_right(toy, search):
    # 37 sentences, default --required-batch-size-multiple 8: fairseq-fixed alone prints 32.
    proc = run_tool(GEN + gen_args(toy, "--user-dir", "fairseq_stream", "--search", search,
                                   "--log-format", "simple", "--log-interval", "1"))
    assert sorted(hypotheses(proc.stdout)) == list(range(37))
    assert re.search(r"Translated 37 sentences", proc.stderr + proc.stdout)
    # The progress log counts every batch, the rescued last one included.
    steps = re.findall(r"(\d+) / (\d+) wps", proc.stderr + proc.stdout)
    assert steps and all(total == steps[-1][1] for _, total in steps)
    assert steps[-1][0] == steps[-1][1]  # the bar reaches its total


def test_empty_source_lines_each_get_one_output(toy, tmp_path, capsys):
    raw = tmp_path / "raw"
    run_tool([sys.executable, REPO / "scripts" / "make_toy_data.py", raw, "--train", "0", "--valid", "0",
              "--test", "20", "--empty-test-lines", "3", "--seed", "7"])
    lines = (raw / "test.src").read_text().splitlines()
    assert lines.count("") == 3
    run_tool(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
              "--testpref", raw / "test", "--destdir", tmp_path / "bin", "--workers", "1",
              "--srcdict", toy.data_bin / "dict.src.txt", "--tgtdict", toy.data_bin / "dict.tgt.txt"])
    for search in ("beam", "fixed", "var-batch"):
        generate_in_process([tmp_path / "bin", "--path", toy.transformer, "--gen-subset", "test",
                             "--batch-size", "8", "--beam", "5", "--cpu", "--user-dir", plugin_dir(),
                             "--search", search])
        hyps = hypotheses(capsys.readouterr().out)
        assert sorted(hyps) == list(range(len(lines))), search
        if search != "beam":
            for i, line in enumerate(lines):
                if line == "":
                    assert hyps[i][1] == "", (search, i, hyps[i])


def test_wrapper_works_from_any_directory(toy, tmp_path):
    proc = run_tool(["fairseq-stream-generate"] + gen_args(toy, "--search", "fixed"), cwd=tmp_path)
    assert sorted(hypotheses(proc.stdout)) == list(range(37))
    user_dir = run_tool(["fairseq-stream-user-dir"], cwd=tmp_path).stdout.strip()
    proc = run_tool(GEN + gen_args(toy, "--user-dir", user_dir, "--search", "beam"), cwd=tmp_path)
    assert len(hypotheses(proc.stdout)) == 37


@pytest.mark.parametrize("search", ["beam", "fixed", "var-batch"])
def test_interactive_answers_every_line(toy, search):
    lines = (toy.raw / "test.src").read_text().splitlines()[:9]
    proc = run_tool(
        ["fairseq-interactive", toy.data_bin, "--path", toy.transformer, "--source-lang", "src",
         "--target-lang", "tgt", "--beam", "5", "--cpu", "--buffer-size", "4", "--batch-size", "4",
         "--user-dir", "fairseq_stream", "--search", search],
        input="\n".join(lines) + "\n",
    )
    assert sorted(hypotheses(proc.stdout)) == list(range(len(lines)))


def test_over_long_input_is_a_one_line_error_or_an_explicit_warning(toy, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    long_line = " ".join("s{}".format(i % 300) for i in range(1100))  # > 1024 positions
    (raw / "test.src").write_text("s1 s2 s3\n" + long_line + "\n")
    (raw / "test.tgt").write_text("t1 t2 t3\nt1\n")
    run_tool(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
              "--testpref", raw / "test", "--destdir", tmp_path / "bin", "--workers", "1",
              "--srcdict", toy.data_bin / "dict.src.txt", "--tgtdict", toy.data_bin / "dict.tgt.txt"])
    args = ["fairseq-generate", tmp_path / "bin", "--path", toy.transformer, "--gen-subset", "test",
            "--batch-size", "8", "--cpu", "--user-dir", "fairseq_stream", "--search", "fixed"]
    proc = run_tool(args, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # Plain numbers: fairseq's text printed "(=(np.int32(1101), np.int32(2)))".
    assert last == ("fairseq-stream: error: an input is longer than the model's positions: sentence 1 is (1101, 2) "
                    "tokens long (EOS included; source, target), the model takes (1024, 1024); skip such inputs "
                    "with --skip-invalid-size-inputs-valid-test")

    proc = run_tool(args + ["--skip-invalid-size-inputs-valid-test"])
    assert sorted(hypotheses(proc.stdout)) == [0]
    assert "1 input sentence(s) exceed the model's positions" in proc.stderr


@pytest.mark.parametrize("buffer", [1, 2])
def test_interactive_names_the_over_long_line(toy, buffer):
    """fairseq-interactive named it "sample #0", its index in the buffer of lines (issue 49, item 9)."""
    long_line = " ".join("s{}".format(i % 300) for i in range(1100))  # > 1024 positions
    proc = run_tool(
        ["fairseq-interactive", toy.data_bin, "--path", toy.transformer, "--source-lang", "src",
         "--target-lang", "tgt", "--cpu", "--buffer-size", buffer, "--batch-size", buffer,
         "--user-dir", "fairseq_stream", "--search", "greedy"],
        input="s1 s2\ns3 s4 s5\n{}\ns1\n".format(long_line), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert sorted(hypotheses(proc.stdout)) == [0, 1]
    # The statistics' line may follow it, at exit.
    assert [line for line in proc.stderr.splitlines() if "error" in line] == [
        "fairseq-stream: error: input line 3 is longer than the model's positions: 1101 tokens (EOS included), "
        "at most 1024; shorten or split it, or skip such lines with --skip-invalid-size-inputs-valid-test"]




def test_user_dir_tool_takes_no_arguments(tmp_path):
    """``fairseq-stream-user-dir --bogus`` printed the path, status 0; ``--help`` did the same."""
    proc = run_tool(["fairseq-stream-user-dir", "--bogus"], check=False)
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
    assert "--user-dir" in run_tool(["fairseq-stream-user-dir", "--help"]).stdout
    assert run_tool(["fairseq-stream-user-dir"]).stdout.strip() == plugin_dir()


def test_the_multi30k_scripts_name_a_missing_data_directory_before_writing(tmp_path):
    """A mistyped DATA_DIR left OUT_DIR/spm and sentencepiece's NOT_FOUND traceback."""
    for argv in (["python", REPO / "scripts" / "spm_prepare.py"], ["bash", REPO / "scripts" / "train_multi30k.sh"]):
        proc = run_tool(argv + [tmp_path / "no-data", tmp_path / "out"], check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "{}: no train.de".format(tmp_path / "no-data") in proc.stderr
        assert not (tmp_path / "out").exists()
