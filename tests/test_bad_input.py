"""Bad input gets a one-line error naming what is wrong, never a traceback from inside fairseq.

Option errors are checked in-process (fairseq's own parser with the plugin's
patches, as fairseq-generate runs it); a few subprocess tests check the
one-line format users see on the command line.
"""

import os
import random

import pytest
import torch

from conftest import hypotheses, parse_generate_args, run_tool, unsafe_copy
from fairseq_stream.checkpoint import is_trusted, load_state, trust_checkpoints, untrust_checkpoints
from fairseq_stream.cli import plugin_dir
from fairseq_stream.errors import CheckpointError, FairseqStreamError, UnsafeCheckpointError


def translator(toy, path, **kwargs):
    from fairseq_stream.api import Translator

    return Translator([str(path)], data=str(toy.data_bin), **kwargs)


def parse_generate(argv, capsys):
    """fairseq-generate's argument parsing in-process; returns (args or None, the error line or None)."""
    try:
        args = parse_generate_args(argv)
    except SystemExit:
        err = capsys.readouterr().err.strip().splitlines()
        return None, err[-1] if err else ""
    return args, None


def one_line_error(proc):
    """The command failed with a fairseq-stream error as its last stderr line, and no traceback."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


# -- trust is for one file, as it is, for one load ---------------------------------


def test_trusting_one_checkpoint_trusts_exactly_that_file(toy, tmp_path):
    a, b = unsafe_copy(toy, tmp_path / "a.pt"), unsafe_copy(toy, tmp_path / "b.pt")
    trust_checkpoints([str(a)])
    try:
        assert is_trusted(str(a)) and not is_trusted(str(b))
        assert "extra_state" in load_state(str(a))
        with pytest.raises(UnsafeCheckpointError):
            load_state(str(b))
        # A file replaced at the trusted path is a different file: checked again.
        os.replace(b, a)
        assert not is_trusted(str(a))
        with pytest.raises(UnsafeCheckpointError):
            load_state(str(a))
    finally:
        untrust_checkpoints([str(a)])


def test_a_trusted_file_rewritten_in_place_with_the_same_size_is_checked_again(toy, tmp_path):
    """Same path, inode and size: only the modification time tells that the contents may have changed."""
    path = unsafe_copy(toy, tmp_path / "a.pt")
    trust_checkpoints([str(path)])
    try:
        before = os.stat(path)
        data = path.read_bytes()
        with open(path, "r+b") as f:  # in place: the inode stays
            f.write(data)
        # A later time, set explicitly: file systems with coarse timestamps could keep the old one.
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        after = os.stat(path)
        assert (after.st_dev, after.st_ino, after.st_size) == (before.st_dev, before.st_ino, before.st_size)
        assert not is_trusted(str(path))
        with pytest.raises(UnsafeCheckpointError):
            load_state(str(path))
    finally:
        untrust_checkpoints([str(path)])


def test_api_trust_applies_to_that_load_only(toy, tmp_path):
    path = unsafe_copy(toy, tmp_path / "unsafe.pt")
    assert translator(toy, path, trust_checkpoint=True, pool=4).task is not None
    assert not is_trusted(str(path))
    with pytest.raises(UnsafeCheckpointError) as err:
        translator(toy, path, pool=4)
    message = str(err.value)
    assert "trust_checkpoint=True" in message and "trust=True" not in message.replace("trust_checkpoint=True", "")
    assert "\n" not in message


# -- files that are not checkpoints --------------------------------------------


def bad_files(toy, directory):
    """name -> (path, what the error must say)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = toy.transformer.read_bytes()
    (directory / "truncated.pt").write_bytes(data[: len(data) // 3])
    (directory / "text.pt").write_text("this is not a checkpoint\n")
    (directory / "corrupt.pt").write_bytes(random.Random(0).randbytes(100))
    torch.save({"weights": torch.zeros(2)}, directory / "not_fairseq.pt")
    (directory / "a_directory.pt").mkdir(exist_ok=True)
    return {
        "truncated": (directory / "truncated.pt", "truncated or corrupt"),
        "text": (directory / "text.pt", "not a torch checkpoint file"),
        "corrupt": (directory / "corrupt.pt", "not a torch checkpoint"),
        "not_fairseq": (directory / "not_fairseq.pt", "not a fairseq checkpoint"),
        "missing": (directory / "missing.pt", "does not exist"),
        "directory": (directory / "a_directory.pt", "is a directory"),
    }


@pytest.mark.parametrize("name", ["truncated", "text", "corrupt", "not_fairseq", "missing", "directory"])
def test_bad_checkpoint_files_are_one_line_errors_naming_the_file(toy, tmp_path, name):
    path, says = bad_files(toy, tmp_path)[name]
    with pytest.raises(CheckpointError) as err:
        translator(toy, path, pool=4)
    message = str(err.value)
    assert str(path) in message and says in message and "\n" not in message
    assert "could run code" not in message  # a broken file is not an unsafe one
    assert not isinstance(err.value, UnsafeCheckpointError)


@pytest.mark.parametrize("tool", ["fairseq-generate", "fairseq-interactive"])
def test_bad_checkpoint_on_the_command_line(toy, tmp_path, tool):
    files = bad_files(toy, tmp_path)
    for name in ("truncated", "missing"):
        path, says = files[name]
        args = [tool, toy.data_bin, "--path", path, "--user-dir", "fairseq_stream", "--search", "var-batch", "--cpu"]
        args += ["--gen-subset", "test"] if tool == "fairseq-generate" else ["--source-lang", "src", "--target-lang", "tgt"]
        last = one_line_error(run_tool(args, check=False, input="s1 s2\n"))
        assert last.startswith("fairseq-stream: error:") and str(path) in last and says in last


def test_a_data_directory_of_other_dictionaries_is_one_line_naming_the_checkpoint(toy, tmp_path):
    """torch's load_state_dict listed every mismatched table in a multi-line RuntimeError, naming no file."""
    import shutil

    other = tmp_path / "data-bin"
    shutil.copytree(toy.data_bin, other)
    for side in ("src", "tgt"):  # the toy shares its embeddings: one dictionary on both sides
        with open(other / "dict.{}.txt".format(side), "a") as f:
            f.write("".join("extra{} 1\n".format(i) for i in range(8)))
    size = len((toy.data_bin / "dict.src.txt").read_text().splitlines()) + 4  # the specials fairseq adds
    says = ("checkpoint {} does not fit the model built for it: its encoder.embed_tokens.weight is {}x"
            .format(toy.transformer, size))
    tail = ("the data directory's dictionary has {} words and the checkpoint's {}: give the data directory "
            "(the dictionaries) it was trained with".format(size + 8, size))
    from fairseq_stream.api import Translator

    with pytest.raises(CheckpointError) as err:
        Translator([str(toy.transformer2), str(toy.transformer)], data=str(other), cpu=True)
    assert str(err.value).startswith(says.replace(str(toy.transformer), str(toy.transformer2)))
    assert str(err.value).endswith(tail)
    last = one_line_error(run_tool(["fairseq-generate", other, "--path", toy.transformer, "--user-dir",
                                    "fairseq_stream", "--search", "var-batch", "--cpu", "--gen-subset", "test"],
                                   check=False))
    assert last.startswith("fairseq-stream: error: " + says) and last.endswith(tail)


@pytest.mark.parametrize("path", ["{}:", ":{}", "{0}::{0}"])
def test_an_empty_name_in_path_is_named_as_such(toy, path):
    """``--path a.pt:`` said "checkpoint  does not exist", naming a file with no name."""
    last = one_line_error(run_tool(["fairseq-generate", toy.data_bin, "--path", path.format(toy.transformer),
                                    "--user-dir", "fairseq_stream", "--search", "greedy", "--cpu", "--gen-subset",
                                    "test"], check=False))
    assert last == "fairseq-stream: error: --path has an empty checkpoint name (a ':' at its start or end, or '::')"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a disk that is always full)")
def test_a_full_disk_or_an_unmakeable_results_path_is_one_line(toy, tmp_path):
    """Each ended in a traceback: OSError from fairseq-generate's print, FileNotFoundError from its makedirs."""
    common = ["fairseq-generate", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
              "--search", "var-batch", "--cpu", "--gen-subset", "test"]
    results = tmp_path / "results"
    results.mkdir()
    (results / "generate-test.txt").symlink_to("/dev/full")
    last = one_line_error(run_tool(common + ["--results-path", results], check=False))
    assert "fairseq-stream: error: [Errno 28] No space left on device" in last or \
        last.startswith("INFO:fairseq_stream:")  # the run's counters, logged at exit, may follow the line
    proc = run_tool(["bash", "-c", 'exec "$@" > /dev/full', "--"] + common, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert "fairseq-stream: error: [Errno 28] No space left on device" in proc.stderr.splitlines()
    last = one_line_error(run_tool(common + ["--results-path", "/proc/nope"], check=False))
    assert last == "fairseq-stream: error: [Errno 2] No such file or directory: '/proc/nope'"


# -- input text ------------------------------------------------------------------


def test_a_pad_symbol_inside_a_line_is_read_as_the_line_without_it_on_an_lstm(toy):
    """A literal <pad> in the longest line of a batch ended an LSTM decode with fairseq's AssertionError (every
    later line lost); a transformer reads such a line as the line without it, and now an LSTM does too."""
    from fairseq_stream.api import Translator

    words = "s4 s5 s6 s7 s8 s9 s10 s11 s12 s13".split()
    padded = ["{} <pad> {}".format(words[0], " ".join(words[1:])), "<pad> s3", "s1 s2 <pad>", "s3"]
    plain = [" ".join(words), "s3", "s1 s2", "s3"]
    for search in ("greedy", "var-stream"):  # the rnn runner, on fairseq's LSTM encoder
        lstm = Translator([str(toy.lstm)], data=str(toy.data_bin), search=search, pool=8, cpu=True)
        assert [t.text for t in lstm.translate(padded)] == [t.text for t in lstm.translate(plain)]
    common = [toy.data_bin, "--path", toy.lstm, "--user-dir", "fairseq_stream", "--source-lang", "src",
              "--target-lang", "tgt", "--cpu", "--buffer-size", "8", "--batch-size", "8", "--search", "beam"]
    ours = run_tool(["fairseq-interactive"] + common, input="\n".join(padded) + "\n")
    assert ours.returncode == 0, ours.stderr[-2000:]
    again = run_tool(["fairseq-interactive"] + common, input="\n".join(plain) + "\n")
    assert hypotheses(ours.stdout) == hypotheses(again.stdout) and len(hypotheses(ours.stdout)) == 4


def test_without_inner_padding_moves_each_pad_to_the_padding_side():
    from fairseq_stream.inner_padding import without_inner_padding

    left = torch.tensor([[5, 1, 6, 2], [1, 1, 7, 2], [1, 8, 1, 2]])
    tokens, lengths = without_inner_padding(left, pad=1, left_pad=True)
    assert tokens.tolist() == [[5, 6, 2], [1, 7, 2], [1, 8, 2]] and lengths.tolist() == [3, 2, 2]
    right = torch.tensor([[5, 1, 6, 2], [7, 2, 1, 1]])
    tokens, lengths = without_inner_padding(right, pad=1, left_pad=False)
    assert tokens.tolist() == [[5, 6, 2], [7, 2, 1]] and lengths.tolist() == [3, 2]
    usual = torch.tensor([[5, 6, 2], [1, 7, 2]])
    assert without_inner_padding(usual, pad=1, left_pad=True)[0] is usual


def test_interactive_names_the_line_that_is_not_utf8(toy, tmp_path):
    text = b"s1 s2 s3\ns4 \xff\xfe s5\ns6\n"
    (tmp_path / "in.txt").write_bytes(text)
    common = ["fairseq-interactive", toy.data_bin, "--path", toy.transformer, "--source-lang", "src",
              "--target-lang", "tgt", "--cpu", "--user-dir", "fairseq_stream", "--search", "var-batch",
              "--buffer-size", "4", "--batch-size", "4"]
    from_file = run_tool(common + ["--input", tmp_path / "in.txt"], check=False)
    # On standard input, also under the C locale (where Python passes bad bytes on as surrogates).
    from_stdin = run_tool(["bash", "-c", 'exec "$@" < "$0"', tmp_path / "in.txt"] + common, check=False,
                          env={"LC_ALL": "C"})
    for proc in (from_file, from_stdin):
        last = one_line_error(proc)
        assert last.startswith("fairseq-stream: error: input line 2 is not valid UTF-8"), last


def test_interactive_names_a_missing_input_file(toy, tmp_path):
    proc = run_tool(["fairseq-interactive", toy.data_bin, "--path", toy.transformer, "--source-lang", "src",
                     "--target-lang", "tgt", "--cpu", "--user-dir", "fairseq_stream", "--search", "beam",
                     "--input", tmp_path / "nope.txt"], check=False)
    last = one_line_error(proc)
    assert last.startswith("fairseq-stream: error: cannot read input file") and "nope.txt" in last


def test_interactive_reads_lines_as_fairseq_does(toy):
    """Line ends \\n, \\r\\n and \\r all end a line, as in Python's text mode."""
    proc = run_tool(["fairseq-interactive", toy.data_bin, "--path", toy.transformer, "--source-lang", "src",
                     "--target-lang", "tgt", "--cpu", "--user-dir", "fairseq_stream", "--search", "beam"],
                    input="s1 s2 s3\r\ns4 s5\rs6\n")
    sources = [l.split("\t")[1] for l in proc.stdout.splitlines() if l.startswith("S-")]
    assert sources == ["s1 s2 s3", "s4 s5", "s6"]


@pytest.fixture(scope="module")
def api(toy):
    return translator(toy, toy.transformer, beam=5, pool=4, batch_size=4)


@pytest.mark.parametrize("bad, says", [
    ("s1 s2 s3", "not a single str; pass [text]"),
    (b"s1 s2", "not a single bytes"),
    (7, "not a int"),
    (None, "not a NoneType"),
    (["s1", b"s2"], "input sentence 1 is a bytes, not a str"),
    (["s1", None], "input sentence 1 is a NoneType, not a str"),
    (["s1", "s2", "s3 \udcff s4"], "input sentence 2 is not valid UTF-8 text"),
])
def test_api_refuses_what_is_not_a_list_of_sentences(api, bad, says):
    with pytest.raises(FairseqStreamError) as err:
        list(api.translate(bad))
    assert says in str(err.value)


@pytest.mark.parametrize("bad_line", [2, 300])
def test_api_names_the_line_of_a_file_that_is_not_utf8(api, tmp_path, bad_line):
    """A text file decodes 8 KB at a time: the error named the sentence where that chunk began (224 for a bad
    line 300), not the line holding the bad byte."""
    path = tmp_path / "in.txt"
    lines = ["s{} s{} s3 s4 s5 s6 s7 s8 s9 s10 s11 s12\r\n".format(i, i + 1).encode() for i in range(600)]
    lines[bad_line - 1] = b"s3 \xff s4\n"
    path.write_bytes(b"".join(lines))
    with open(path, encoding="utf-8") as f, pytest.raises(FairseqStreamError) as err:
        list(api.translate(f))
    assert str(err.value) == "input sentence {} (line {} of {}) is not valid utf-8: invalid start byte".format(
        bad_line - 1, bad_line, path)


def test_api_says_where_reading_a_stream_that_is_not_utf8_failed(api):
    import io

    stream = io.TextIOWrapper(io.BytesIO(b"s1 s2\ns3 \xff s4\n"), encoding="utf-8")  # no file to read again
    with pytest.raises(FairseqStreamError) as err:
        list(api.translate(stream))
    assert str(err.value).startswith("reading input sentence 0 or one soon after it failed (a text file decodes "
                                     "in chunks): UnicodeDecodeError")


@pytest.mark.parametrize("kwargs, says", [
    (dict(beam=0), "--beam must be at least 1, got 0"),
    (dict(pool=0), "pool must be at least 1, got 0"),
    (dict(batch_size=-1), "batch_size must be at least 1"),
    (dict(stream_eps="2"), "--stream-eps must be in (0, 1]"),
    (dict(sampling=True), "--search var-stream does not support --sampling"),
    (dict(search="var", sampling=True), "--search var does not support --sampling"),
    (dict(search="var", prune_rp=2.0), "--prune-rp must be in (0, 1]"),
    (dict(stream_max_wait=-1), "--stream-max-wait must be >= 0"),
    (dict(stream_max_cached=10), "stream_max_cached has no effect in the Python API"),
    (dict(stream_pool=8), "stream_pool has no effect in the Python API: give pool=N"),
    (dict(no_such_option=1), "unknown option 'no_such_option'"),
])
def test_api_option_errors_name_the_option_before_loading(toy, tmp_path, kwargs, says):
    # The checkpoint does not exist: the option error must come first.
    with pytest.raises(FairseqStreamError) as err:
        translator(toy, tmp_path / "missing.pt", **kwargs)
    assert says in str(err.value)


# -- command-line options --------------------------------------------------------


def generate_args(toy, *extra):
    return [toy.data_bin, "--path", toy.transformer, "--user-dir", plugin_dir(), "--gen-subset", "test",
            "--cpu"] + list(extra)


@pytest.mark.parametrize("extra, says", [
    (["--search", "fixed", "--beam", "0"], "--beam must be at least 1, got 0"),
    (["--search", "var-batch", "--beam", "-3"], "--beam must be at least 1, got -3"),
    (["--search", "beam", "--beam", "0"], "--beam must be at least 1, got 0"),
    (["--search", "var-stream", "--stream-pool", "0"], "--stream-pool must be at least 1, got 0"),
    (["--search", "fixed", "--generator", "stream", "--stream-pool", "-1"], "--stream-pool must be at least 1"),
    (["--search", "var-stream", "--stream-max-wait", "-1"], "--stream-max-wait must be >= 0"),
    (["--search", "var-stream", "--stream-max-cached", "-1"], "--stream-max-cached must be >= 0"),
    (["--search", "var-stream", "--stream-eps", "2"], "--stream-eps must be in (0, 1]"),
    (["--search", "var-stream", "--stream-eps", "a sixth"], "--stream-eps must be a number"),
    (["--search", "fixed", "--sampling"], "--search fixed does not support --sampling"),
    (["--search", "beam", "--sampling", "--beam", "5"], "--sampling needs --nbest equal to --beam"),
    (["--search", "var", "--prune-rp", "1.5"], "--prune-rp must be in (0, 1]"),
    (["--search", "var", "--prune-ap", "-1"], "--prune-ap (delta) must be >= 0"),
    (["--search", "var", "--prune-mc", "0"], "--prune-mc (M) must be >= 1"),
    (["--search", "var-stream", "--generator", "stream"], "--search var-stream already runs on --generator stream"),
    (["--search", "beam", "--generator", "stream"], "--search beam does not combine with --generator stream"),
    (["--search", "jacobi", "--generator", "stream"], "--search jacobi does not combine with --generator stream"),
    (["--search", "jacobi", "--jacobi-block", "0"], "--jacobi-block must be at least 1, got 0"),
    (["--search", "jacobi", "--jacobi-horizon", "-2"], "--jacobi-horizon must be at least 0, got -2"),
    (["--search", "jacobi", "--jacobi-call-cost", "0"], "--jacobi-call-cost must be positive, got 0.0"),
    (["--search", "greedy", "--generator", "topup", "--encoder-queue", "-1"], "--encoder-queue must be >= 0, got -1"),
    (["--search", "greedy", "--maxi-batch", "0"], "--maxi-batch must be at least 1, got 0"),
    (["--generator", "batch"], "--generator batch needs a --search"),
    # Greedy and Jacobi keep one hypothesis: fairseq-generate printed one, silently (issue 32, item 7).
    (["--search", "greedy", "--nbest", "3"], "--search greedy gives one hypothesis per sentence: --nbest 3 asks "
     "for 3 (for an n-best list use --search fixed --beam 5 --nbest 3)"),
    (["--search", "jacobi", "--nbest", "2"], "--search jacobi gives one hypothesis per sentence: --nbest 2"),
    (["--search", "greedy", "--generator", "topup", "--nbest", "2"], "--search greedy gives one hypothesis"),
    (["--search", "var-stream", "--beam", "2", "--nbest", "3"],
     "--nbest 3 asks for more hypotheses than --beam 2 keeps; raise --beam to 3 or more"),
    # fairseq-generate printed the first sentence, then a KeyError or fairseq's AssertionError (issue 49, item 6).
    (["--search", "greedy", "--print-step"], "--search greedy does not support --print-step: it prints what only "
     "iterative refinement returns (--task translation_lev)"),
    (["--search", "fixed", "--retain-iter-history"], "--search fixed does not support --retain-iter-history"),
    (["--search", "fixed", "--replace-unk"], "--search fixed does not support --replace-unk: it needs alignments, "
     "which our searches do not produce (fairseq's own beam search has them: --search beam --print-alignment, "
     "where fairseq reads raw text, as fairseq-interactive does)"),
    (["--search", "jacobi", "--replace-unk", "align.txt"], "--search jacobi does not support --replace-unk"),
    # A ZeroDivisionError after the whole run; fairseq's AssertionError at the first batch.
    (["--search", "var-stream", "--nbest", "0"], "--nbest must be at least 1, got 0"),
    (["--search", "beam", "--nbest", "0"], "--nbest must be at least 1, got 0"),
    (["--search", "beam", "--min-len", "300"], "--min-len 300 is larger than the maximum length --max-len-b 200"),
    (["--search", "fixed", "--min-len", "30", "--max-len-b", "20"], "--min-len 30 is larger than the maximum "
     "length --max-len-b 20; adjust --max-len-a/-b"),
    # fairseq-generate's literal_eval after loading the task: a SyntaxError traceback.
    (["--search", "beam", "--model-overrides", "{bad"], "--model-overrides '{bad' is not a Python dict literal, "
     "e.g. \"{'max_source_positions': 2048}\""),
    (["--search", "var-stream", "--model-overrides", "[1]"], "--model-overrides must be a dict"),
    # Ignored by our searches (fairseq asserts them when it builds its generator: a traceback).
    (["--search", "fixed", "--sampling-topk", "5"], "--sampling-topk 5 needs --sampling"),
    (["--search", "greedy", "--sampling-topp", "0.5"], "--sampling-topp 0.5 needs --sampling"),
    (["--search", "beam", "--sampling-topk", "5"], "--sampling-topk 5 needs --sampling"),
    (["--search", "beam", "--temperature", "0"], "--temperature must be greater than 0, got 0.0"),
    # Refused after the model had loaded, status 1.
    (["--search", "fixed", "--temperature", "-1"], "--temperature must be greater than 0, got -1.0"),
    (["--search", "jacobi", "--no-repeat-ngram-size", "2"], "--search jacobi does not support "
     "--no-repeat-ngram-size (use --search greedy)"),
])
def test_option_errors_are_caught_when_parsing(toy, capsys, extra, says):
    args, error = parse_generate(generate_args(toy, *extra), capsys)
    assert args is None and error is not None
    assert ": error: " + says in error, error  # argparse's one line (the program name varies in-process)


@pytest.mark.parametrize("tool, option", [("fairseq-generate", "--print-step"),
                                          ("fairseq-interactive", "--replace-unk")])
def test_options_for_other_generators_are_one_line_errors_before_any_output(toy, tool, option):
    proc = run_tool([tool] + generate_args(toy, "--search", "greedy", option), check=False, input="s1 s2\n")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert one_line_error(proc).startswith("{}: error: --search greedy does not support {}".format(tool, option))


@pytest.mark.parametrize("search", ["beam", "var-stream"])
def test_a_batch_whose_maximum_length_is_below_min_len_is_one_line(toy, search):
    """A maximum that grows with the source is known per batch: fairseq's beam asserted (a traceback)."""
    proc = run_tool(["fairseq-generate"] + generate_args(toy, "--search", search, "--min-len", "30", "--max-len-a",
                                                         "0.5", "--max-len-b", "5"), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert one_line_error(proc) == ("fairseq-stream: error: --min-len is larger than the maximum length of a "
                                    "batch; adjust --max-len-a/-b")


@pytest.mark.parametrize("buffer", [[], ["--buffer-size", "4"]])
def test_interactive_batch_larger_than_its_buffer_is_one_line(toy, buffer):
    """fairseq-interactive asserted it after loading the model: an AssertionError traceback."""
    proc = run_tool(["fairseq-interactive"] + generate_args(toy, "--search", "greedy", "--batch-size", "8")
                    + buffer, check=False, input="s1 s2\n")
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line_error(proc) == ("fairseq-interactive: error: --batch-size 8 cannot be larger than --buffer-size "
                                    "{} (the lines read at once; give --buffer-size 8 or more)".format(
                                        buffer[1] if buffer else 1))


def test_greedy_ignores_the_beam_option(toy, capsys):
    args, error = parse_generate(generate_args(toy, "--search", "greedy", "--beam", "0"), capsys)
    assert error is None and args.search == "greedy"
    # What fairseq prints of the beam (the BLEU line) says what ran (issue 49, item 9).
    assert args.beam == 1
    args, error = parse_generate(generate_args(toy, "--search", "fixed", "--beam", "4"), capsys)
    assert error is None and args.beam == 4


def test_jacobi_and_greedy_say_that_they_ignore_the_beam(toy):
    """Jacobi used to ignore --beam 5 without a word; its output is greedy's, with one warning line."""
    greedy = run_tool(["fairseq-generate"] + generate_args(toy, "--search", "greedy", "--batch-size", "8"))
    assert "is ignored" not in greedy.stderr
    for search in ("jacobi", "greedy"):
        proc = run_tool(["fairseq-generate"] + generate_args(toy, "--search", search, "--batch-size", "8", "--beam", "5"))
        assert hypotheses(proc.stdout) == hypotheses(greedy.stdout)
        assert ("fairseq-stream: --search {} decodes greedily (one hypothesis, beam 1): --beam 5 is ignored"
                .format(search)) in proc.stderr
        # fairseq-generate's BLEU line said beam=5 (issue 49, item 9).
        assert "\nGenerate test with beam=1: BLEU4 = " in proc.stdout


def test_nbest_with_greedy_is_a_one_line_error_on_the_command_line(toy):
    for search in ("greedy", "jacobi"):
        proc = run_tool(["fairseq-generate"] + generate_args(toy, "--search", search, "--nbest", "3"), check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert one_line_error(proc) == ("fairseq-generate: error: --search {} gives one hypothesis per sentence: "
                                        "--nbest 3 asks for 3 (for an n-best list use --search fixed --beam 5 "
                                        "--nbest 3)".format(search))


def test_nbest_with_greedy_is_refused_by_the_api_and_a_direct_build(toy, loaded):
    from fairseq.dataclass.configs import GenerationConfig

    from fairseq_stream.api import Translator
    from fairseq_stream.registry import SEARCH_DATACLASS_REGISTRY, SEARCH_REGISTRY

    with pytest.raises(FairseqStreamError, match="^--search greedy gives one hypothesis per sentence: --nbest 2"):
        Translator(str(toy.transformer), data=str(toy.data_bin), search="greedy", nbest=2, cpu=True)
    models, task = loaded("transformer")
    for search in ("greedy", "jacobi"):
        gen_cfg = GenerationConfig(nbest=2)
        with pytest.raises(FairseqStreamError, match="^--search {} gives one hypothesis".format(search)):
            SEARCH_REGISTRY[search].build(task, models, gen_cfg, SEARCH_DATACLASS_REGISTRY[search](), None, None)


def test_option_errors_are_one_line_on_the_command_line(toy):
    for extra in (["--search", "var", "--prune-rp", "1.5"], ["--search", "var-stream", "--stream-pool", "0"],
                  ["--search", "jacobi", "--generator", "stream"], ["--search", "fixed", "--beam", "0"]):
        proc = run_tool(["fairseq-generate"] + generate_args(toy, *extra), check=False)
        assert proc.returncode == 2
        assert one_line_error(proc).startswith("fairseq-generate: error: --")
        # argparse's usage text came first: 140 to 230 lines of it above the one that says what is wrong.
        assert "usage:" not in proc.stderr


def test_max_tokens_below_a_sentence_is_a_one_line_error(loaded):
    """fairseq asserts (a traceback) when a sentence is longer than --max-tokens."""
    _, task = loaded("transformer")
    with pytest.raises(FairseqStreamError) as err:
        # The session's task is shared: without disable_iterator_cache fairseq
        # hands back an iterator another test made, and nothing is batched.
        task.get_batch_iterator(dataset=task.dataset("test"), max_tokens=5,
                                disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    assert "longer than --max-tokens" in str(err.value) and "\n" not in str(err.value)


def test_max_tokens_error_on_the_command_line(toy):
    last = one_line_error(run_tool(["fairseq-generate"] + generate_args(toy, "--search", "fixed", "--max-tokens", "5"),
                                   check=False))
    assert last.startswith("fairseq-stream: error: an input is longer than --max-tokens")


# -- --retain-dropout: only fairseq's modules apply dropout while decoding -------------------------

DROPOUT = ["--retain-dropout", "--model-overrides", "{'dropout': 0.05}", "--beam", "5", "--batch-size", "16"]


def test_retain_dropout_decodes_on_the_fairseq_runner(toy):
    """Our runners' steps have no dropout: they gave the deterministic translations, silently (BLEU 46.75 on the
    toy's test set where fairseq's beam with the dropout gave 16.06)."""
    auto = run_tool(["fairseq-generate"] + generate_args(toy, "--search", "var-batch", *DROPOUT))
    assert ("fairseq-stream: using the fairseq runner (--retain-dropout keeps dropout while decoding "
            "(encoder.dropout_module p=0.05), which only it applies)") in auto.stderr
    fairseq_runner = run_tool(["fairseq-generate"] + generate_args(toy, "--search", "var-batch", "--runner", "fairseq",
                                                                   *DROPOUT))
    assert hypotheses(auto.stdout) == hypotheses(fairseq_runner.stdout)  # fairseq's seed: the same masks
    without = run_tool(["fairseq-generate"] + generate_args(toy, "--search", "var-batch", "--beam", "5",
                                                            "--batch-size", "16", "--model-overrides",
                                                            "{'dropout': 0.05}"))
    assert hypotheses(auto.stdout) != hypotheses(without.stdout)


@pytest.mark.parametrize("extra, asked", [(["--search", "var-batch", "--runner", "lean"], "--runner lean"),
                                          (["--search", "fixed", "--quantize", "int8"], "--quantize int8")])
def test_retain_dropout_with_one_of_our_runners_is_a_one_line_error(toy, extra, asked):
    proc = run_tool(["fairseq-generate"] + generate_args(toy, *extra, *DROPOUT), check=False)
    assert one_line_error(proc) == (
        "fairseq-stream: error: --retain-dropout keeps dropout while decoding (encoder.dropout_module p=0.05), "
        "which only the fairseq runner applies: {} runs without it; drop one of the two".format(asked))
    assert "H-" not in proc.stdout


def test_jacobi_names_retain_dropout_as_what_keeps_it_off_the_lean_runner(toy):
    proc = run_tool(["fairseq-generate"] + generate_args(toy, "--search", "jacobi", *DROPOUT), check=False)
    assert "--retain-dropout keeps dropout while decoding" in one_line_error(proc)


def test_retain_dropout_of_probability_zero_keeps_our_runners(toy):
    """fairseq marks the modules even where their probability is 0 (the toy's own): nothing changes there."""
    proc = run_tool(["fairseq-generate"] + generate_args(toy, "--search", "var-batch", "--retain-dropout"))
    assert "--retain-dropout" not in proc.stderr and "using the lean runner" in proc.stderr


# -- --nbest with pruning: fewer hypotheses are said, not silent ------------------------------------


def short_of(stdout: str, nbest: int) -> int:
    counts = {}
    for line in stdout.splitlines():
        if line.startswith("H-"):
            sentence = line.split("\t", 1)[0]
            counts[sentence] = counts.get(sentence, 0) + 1
    sources = sum(line.startswith("S-") for line in stdout.splitlines())
    assert len(counts) == sources  # every sentence has at least one
    return sum(c < nbest for c in counts.values())


@pytest.mark.parametrize("workers", ["1", "2"])  # two: the workers' own counts are not added to the parent's
def test_sentences_with_fewer_than_nbest_hypotheses_are_counted_in_one_warning(toy, workers):
    # --prune-ap 0 keeps only the best candidate of a beam: the final beams are narrow whatever the toy learned.
    extra = ["--search", "var", "--prune-ap", "0", "--beam", "5", "--nbest", "3", "--batch-size", "16",
             "--cpu-workers", workers]
    proc = run_tool(["fairseq-generate"] + generate_args(toy, *extra))
    short = short_of(proc.stdout, 3)
    assert short > 0
    assert ("fairseq-stream: {} of 37 sentences got fewer than --nbest 3 hypotheses: --search var's pruning keeps "
            "fewer finished ones in a sentence's final beam (docs/pruning.md)".format(short)) in proc.stderr
    full = run_tool(["fairseq-generate"] + generate_args(toy, "--search", "fixed", "--beam", "5", "--nbest", "3"))
    assert short_of(full.stdout, 3) == 0 and "got fewer than --nbest" not in full.stderr


# -- a data directory fairseq cannot read the dictionaries from --------------------------------------


@pytest.mark.parametrize("data, says", [
    ("missing", "data directory {missing}: {missing} does not exist; give the data-bin directory"),
    ("empty", "data directory {empty}: no dict.SRC.txt and dict.TGT.txt in it; give the data-bin directory"),
])
def test_a_bad_data_directory_is_one_line_naming_it(toy, tmp_path, data, says):
    """fairseq's task raised FileNotFoundError or a bare Exception ("Could not infer language pair") from deep
    inside its setup (the API, the bulk tool)."""
    from fairseq_stream.api import Translator

    places = {"missing": tmp_path / "no-such-data-bin", "empty": tmp_path / "empty"}
    places["empty"].mkdir()
    with pytest.raises(FairseqStreamError) as error:
        Translator([str(toy.transformer)], data=str(places[data]), cpu=True)
    assert str(error.value).startswith(says.format(**places))


def test_a_checkpoints_own_data_directory_gone_is_one_line(toy, tmp_path):
    # The toy's checkpoints name the directory they were trained from: a temporary one, renamed since.
    from fairseq_stream.api import Translator

    if os.path.exists(load_state(str(toy.transformer))["cfg"]["task"]["data"]):
        pytest.skip("this toy's checkpoint names a data directory that exists")

    with pytest.raises(FairseqStreamError, match=r"^the checkpoint's data directory \(no data= / --data given\): "
                                                 r".* does not exist; give the data-bin directory"):
        Translator([str(toy.transformer)], cpu=True)


def test_the_bulk_tool_names_a_missing_data_directory(toy, tmp_path):
    proc = run_tool(["fairseq-stream-bulk", "translate", "--input", toy.raw / "test.src", "--output",
                     tmp_path / "out.txt", "--path", toy.transformer, "--cpu", "--data", tmp_path / "nope"],
                    check=False)
    assert one_line_error(proc).startswith("fairseq-stream: error: data directory {0}: {0} does not exist".format(
        tmp_path / "nope"))


def test_the_api_takes_an_ensemble_as_fairseqs_path_writes_it(toy):
    """``paths="a.pt:b.pt"`` was one missing file ("checkpoint a.pt:b.pt does not exist")."""
    from fairseq_stream.api import Translator

    joined = Translator("{}:{}".format(toy.transformer, toy.transformer2), data=str(toy.data_bin), cpu=True)
    listed = Translator([str(toy.transformer), str(toy.transformer2)], data=str(toy.data_bin), cpu=True)
    assert len(joined.models) == 2
    sentences = ["s64 s30 s173 s78", "s237 s76 s3 s128"]
    assert [t.text for t in joined.translate(sentences)] == [t.text for t in listed.translate(sentences)]
    with pytest.raises(FairseqStreamError, match="^paths: an empty checkpoint name in "):
        Translator("{}:".format(toy.transformer), data=str(toy.data_bin), cpu=True)


@pytest.mark.parametrize("extra, says", [
    (["--beam", "0"], "--beam must be at least 1, got 0"),  # it named --option nbest=1, which nobody gave
    (["--path", "PATH:"], "--path 'PATH:': an empty checkpoint name (an ensemble is a.pt:b.pt)"),
])
def test_bulk_option_errors_name_the_option_given(toy, tmp_path, extra, says):
    extra = [str(toy.transformer) + ":" if e == "PATH:" else e for e in extra]
    says = says.replace("PATH:", str(toy.transformer) + ":")
    argv = ["fairseq-stream-bulk", "translate", "--input", toy.raw / "test.src", "--output", tmp_path / "out.txt",
            "--path", toy.transformer, "--data", toy.data_bin, "--cpu"] + extra
    assert one_line_error(run_tool(argv, check=False)) == "fairseq-stream: error: " + says


def test_a_reader_that_goes_away_ends_interactive_without_a_traceback(toy):
    """``fairseq-interactive ... | head -2`` ended in fairseq's BrokenPipeError traceback (print to a closed pipe)."""
    import subprocess

    from conftest import BIN, tool_env

    argv = [str(BIN / "fairseq-interactive")] + [str(a) for a in generate_args(toy, "--search", "greedy")]
    with open(toy.raw / "train.src") as source:
        proc = subprocess.Popen(argv, stdin=source, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=tool_env())
        assert proc.stdout.readline().startswith("S-0\t")
        proc.stdout.close()  # as head does after its lines
        _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]
