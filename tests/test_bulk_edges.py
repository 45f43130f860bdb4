"""``fairseq-stream-bulk`` where a hostile or careless user takes it (issue 32): outputs that are not
regular files, ``--option`` values, over-long lines, ``merge`` in the wrong folder, a killed torchrun.

Most runs call the command's ``main`` in this process (the toy model loads in
about a second); a few run it as a subprocess where what is checked is the
process itself: a one-line error and the exit status, a pipe given as
/dev/fd/N, ranks that must die with their launcher.
"""

import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, run_plain_fairseq_generate, run_tool, tool_env
from fairseq_stream.errors import FairseqStreamError
from test_bulk import CHUNK, corpus, expected  # noqa: F401  (fixtures)


def common(toy, command):
    args = ["--path", toy.transformer, "--data", toy.data_bin, "--chunk-size", CHUNK]
    if command == "translate":
        args += ["--cpu", "--pool", "16", "--no-progress-bar"]
    return args


def bulk_main(toy, *args, chunk_size=None):
    """Run the command's ``main`` in this process (FairseqStreamError raises as it is)."""
    from fairseq_stream.bulk import main

    extra = common(toy, args[0])
    if chunk_size is not None:
        extra[extra.index("--chunk-size") + 1] = chunk_size
    main([str(a) for a in list(args) + extra])


def counts(caplog):
    """(chunks translated, chunks found done) from rank 0's last log line."""
    for record in reversed(caplog.records):
        message = record.getMessage()
        if "fairseq-stream bulk: rank 0 translated" in message:
            words = message.split("fairseq-stream bulk: rank 0 ")[1].split()
            return int(words[1]), int(words[4])
    raise AssertionError("no summary line logged")


def last_line(proc):
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def finished(toy, corpus, tmp_path_factory):  # noqa: F811
    """A finished job: (its text output, its work directory)."""
    out = tmp_path_factory.mktemp("finished") / "out.txt"
    bulk_main(toy, "translate", "--input", corpus[0], "--output", out)
    return out, str(out) + ".chunks"


def merge_into(toy, corpus, finished, output, *extra):  # noqa: F811
    bulk_main(toy, "merge", "--input", corpus[0], "--output", output, "--work-dir", finished[1], *extra)


# --- outputs that are not regular files -------------------------------------------------------------

def device(tmp_path, name, minor):
    """A twin of /dev/null (minor 3) or /dev/full (minor 7) in ``tmp_path``: a broken fix replaces it, not /dev's."""
    path = tmp_path / name
    try:
        os.mknod(str(path), stat.S_IFCHR | 0o666, os.makedev(1, minor))
        os.close(os.open(str(path), os.O_WRONLY))
    except OSError as e:  # not root, or a file system mounted nodev
        pytest.skip("cannot make a device node here: {}".format(e))
    return path


def test_a_device_is_written_into_never_replaced(toy, corpus, finished, tmp_path):  # noqa: F811
    null = device(tmp_path, "null", 3)
    merge_into(toy, corpus, finished, null)
    assert stat.S_ISCHR(os.stat(str(null)).st_mode)
    full = device(tmp_path, "full", 7)
    with pytest.raises(FairseqStreamError, match=r"^cannot write --output .*/full: No space left on device$"):
        merge_into(toy, corpus, finished, full)
    assert stat.S_ISCHR(os.stat(str(full)).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "null"]  # no temporary file left either


def test_a_fifo_is_written_into(toy, corpus, finished, tmp_path):  # noqa: F811
    fifo = tmp_path / "fifo"
    os.mkfifo(str(fifo))
    received = []
    reader = threading.Thread(target=lambda: received.append(open(str(fifo), "rb").read()), daemon=True)
    reader.start()
    merge_into(toy, corpus, finished, fifo)
    reader.join(timeout=30)
    assert received == [finished[0].read_bytes()]
    assert stat.S_ISFIFO(os.stat(str(fifo)).st_mode)


def test_a_symlink_is_followed_and_kept(toy, corpus, finished, tmp_path):  # noqa: F811
    target, link = tmp_path / "target.txt", tmp_path / "link.txt"
    target.write_text("old\n")
    os.chmod(str(target), 0o640)
    link.symlink_to(target.name)
    merge_into(toy, corpus, finished, link)
    assert link.is_symlink() and os.readlink(str(link)) == target.name
    assert target.read_bytes() == finished[0].read_bytes()
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the replaced file keeps its permissions

def test_a_symlink_to_nothing_is_refused(toy, corpus, finished, tmp_path):  # noqa: F811
    """Writing through it created its target and the folders on the way (issue 49, item 8)."""
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to("new/made.txt")
    message = r"^--output .*/dangling.txt is a symbolic link to new/made.txt, which does not exist; "
    with pytest.raises(FairseqStreamError, match=message):
        merge_into(toy, corpus, finished, dangling)
    with pytest.raises(FairseqStreamError, match=message):  # refused before the model loads
        bulk_main(toy, "translate", "--input", corpus[0], "--output", dangling)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.txt"]


def test_a_read_only_output_is_refused(toy, corpus, finished, tmp_path):  # noqa: F811
    """A 0444 file was replaced silently (the rename needs only its folder writable; issue 49, item 8)."""
    out, link = tmp_path / "kept.txt", tmp_path / "link.txt"
    out.write_text("mine\n")
    os.chmod(str(out), 0o444)
    link.symlink_to(out.name)
    for output in (out, link):
        with pytest.raises(FairseqStreamError, match=r"^--output .*/{} is read-only \(mode 444\); make it "
                           r"writable".format(output.name)):
            merge_into(toy, corpus, finished, output)
    with pytest.raises(FairseqStreamError, match=r"is read-only"):
        bulk_main(toy, "translate", "--input", corpus[0], "--output", out, "--work-dir", tmp_path / "work")
    assert out.read_text() == "mine\n" and stat.S_IMODE(out.stat().st_mode) == 0o444
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "link.txt"]
    os.chmod(str(out), 0o644)  # made writable, it is replaced as before
    merge_into(toy, corpus, finished, out)
    assert out.read_bytes() == finished[0].read_bytes()


def test_proc_and_directories_are_one_line_errors(toy, corpus, finished, tmp_path):  # noqa: F811
    with pytest.raises(FairseqStreamError, match=r"^cannot write --output /proc/version: "):
        merge_into(toy, corpus, finished, "/proc/version")
    with pytest.raises(FairseqStreamError, match=r"is a directory"):
        merge_into(toy, corpus, finished, tmp_path)
    # A device, fifo or pipe has no place for OUTPUT.chunks next to it: --work-dir is asked for.
    null = device(tmp_path, "null", 3)
    with pytest.raises(FairseqStreamError, match=r"is a character device .*give --work-dir"):
        bulk_main(toy, "merge", "--input", corpus[0], "--output", null)


def test_a_pipe_as_dev_fd_and_dev_full_from_the_command_line(toy, corpus, finished, tmp_path):  # noqa: F811
    """``--output >(cat > x)`` is /dev/fd/N, a pipe: written into; /dev/full: one line, exit status 1."""
    read, write = os.pipe()
    argv = [sys.executable, "-m", "fairseq_stream.bulk", "merge", "--input", str(corpus[0]), "--output",
            "/dev/fd/{}".format(write), "--work-dir", finished[1]] + [str(a) for a in common(toy, "merge")]
    proc = subprocess.Popen(argv, cwd=str(REPO), env=tool_env(), pass_fds=[write], stderr=subprocess.PIPE,
                            text=True)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        received = pipe.read()
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert received == finished[0].read_bytes()
    full = device(tmp_path, "full", 7)
    proc = run_tool([sys.executable, "-m", "fairseq_stream.bulk", "merge", "--input", corpus[0], "--output",
                     full, "--work-dir", finished[1]] + common(toy, "merge"), check=False)
    assert proc.returncode == 1
    assert last_line(proc) == "fairseq-stream: error: cannot write --output {}: No space left on device".format(full)


# --- --option --------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, message", [
    ("beam=3", "--option beam=3: use --beam instead"),
    ("search=greedy", "--option search=greedy: use --search instead"),
    ("cpu=False", "--option cpu=False: use --cpu instead"),
    ("pool=2", "--option pool=2: use --pool instead"),
    ("stream-pool=2", "--option stream-pool=2: use --pool instead"),
    ("lenpen=abc", "--option lenpen=abc: lenpen takes a number, got 'abc'"),
    ("max_len_b=1.5", "--option max_len_b=1.5: max_len_b takes an integer, got '1.5'"),
    ("sampling=maybe", "--option sampling=maybe: sampling takes true or false, got 'maybe'"),
    ("stream_refill_unit=words", "--option stream_refill_unit=words: stream_refill_unit must be one of "
                                 "sentences, rows, got 'words'"),
    ("nosuch=1", "--option nosuch=1: unknown option 'nosuch' for --search var-stream"),
    ("lenpen", "--option takes KEY=VALUE, got 'lenpen'"),
])
def test_bad_options_are_named(option, message):
    from fairseq_stream.bulk import options

    with pytest.raises(FairseqStreamError) as e:
        options.checked("var-stream", [option])
    assert str(e.value) == message


def test_options_are_typed_by_the_field_they_set():
    from fairseq_stream.bulk import options

    typed = options.checked("var-stream", ["lenpen=1", "prune_ap=None", "max-len-b=50", "stream_eps=1/4",
                                           "sampling=false"])
    assert typed == {"lenpen": 1.0, "prune_ap": None, "max_len_b": 50, "stream_eps": "1/4", "sampling": False}
    assert type(typed["lenpen"]) is float  # lenpen=1 and lenpen=1.0: one setting, the same chunks
    with pytest.raises(FairseqStreamError, match="given twice"):
        options.checked("var-stream", ["lenpen=1", "lenpen=2"])


def test_a_bad_option_is_one_line_before_any_work(toy, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "out.txt"
    proc = run_tool([sys.executable, "-m", "fairseq_stream.bulk", "translate", "--input", corpus[0], "--output",
                     out, "--option", "beam=3"] + common(toy, "translate"), check=False)
    assert proc.returncode == 1
    assert last_line(proc) == "fairseq-stream: error: --option beam=3: use --beam instead"
    assert not os.path.exists(str(out) + ".chunks")


def test_a_run_that_fails_before_any_chunk_leaves_no_empty_work_dir(toy, corpus, tmp_path):  # noqa: F811
    """The Translator refused stream_eps=2 after OUTPUT.chunks/chunks was made: it was left behind, empty."""
    out = tmp_path / "out.txt"
    with pytest.raises(FairseqStreamError, match=r"--stream-eps must be in \(0, 1\], got 2"):
        bulk_main(toy, "translate", "--input", corpus[0], "--output", out, "--option", "stream_eps=2")
    assert sorted(os.listdir(tmp_path)) == []
    # A work dir holding a finished chunk stays, for the re-run to resume from.
    bulk_main(toy, "translate", "--input", corpus[0], "--output", out)
    with pytest.raises(FairseqStreamError, match="--stream-eps"):
        bulk_main(toy, "translate", "--input", corpus[0], "--output", out, "--option", "stream_eps=2")
    assert os.listdir(str(out) + ".chunks/chunks")


def test_a_second_run_into_the_same_work_dir_is_refused(toy, corpus, tmp_path):  # noqa: F811
    """Two runs into one output each translated every chunk; with other settings both then failed at the
    merge, each finding the other's chunks stale."""
    import fcntl

    out = tmp_path / "out.txt"
    work = tmp_path / "out.txt.chunks"
    (work / "chunks").mkdir(parents=True)
    other_run = os.open(str(work), os.O_RDONLY)
    fcntl.flock(other_run, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the first run holds it
    try:
        with pytest.raises(FairseqStreamError, match="^another fairseq-stream-bulk run is translating into {}; "
                           "wait for it to end, or give this one another --output or --work-dir$".format(work)):
            bulk_main(toy, "translate", "--input", corpus[0], "--output", out)
        assert not out.exists() and os.listdir(str(work / "chunks")) == []
    finally:
        os.close(other_run)
    bulk_main(toy, "translate", "--input", corpus[0], "--output", out)  # the first run over: this one runs
    assert len(out.read_text().splitlines()) == len(corpus[1])


def test_nbest_writes_every_hypothesis_in_generate_format(toy, corpus, expected, tmp_path):  # noqa: F811
    out = tmp_path / "out.txt"
    with pytest.raises(FairseqStreamError, match="give --format generate"):
        bulk_main(toy, "translate", "--input", corpus[0], "--output", out, "--option", "nbest=3")
    with pytest.raises(FairseqStreamError, match=r"nbest must not exceed --beam \(2\)"):
        bulk_main(toy, "translate", "--input", corpus[0], "--output", out, "--option", "nbest=3", "--beam", "2",
                  "--format", "generate")
    bulk_main(toy, "translate", "--input", corpus[0], "--output", out, "--option", "nbest=3", "--format",
              "generate")
    lines = out.read_text().split("\n")[:-1]
    hypotheses = {}
    for line in lines:
        if line.startswith("H-"):
            head, score, text = line.split("\t")
            hypotheses.setdefault(int(head[2:]), []).append((float(score), text))
    assert sorted(hypotheses) == list(range(len(corpus[1])))
    # var-stream prunes its beam: a sentence may finish fewer than nbest hypotheses, most finish all three.
    sizes = [len(h) for h in hypotheses.values()]
    assert max(sizes) == 3 and sizes.count(3) > len(sizes) // 2
    for i, h in hypotheses.items():
        assert [s for s, _ in h] == sorted((s for s, _ in h), reverse=True)
        assert h[0][1] == expected[i][0]  # the best first, as in the text output


def printed_lines(text, kinds=("S-", "H-")):
    """{sentence id: its S-/H- lines in the order printed}."""
    out = {}
    for line in text.splitlines():
        if line[:2] in kinds:
            out.setdefault(int(line.split("\t")[0][2:]), []).append(line)
    return out


@pytest.mark.parametrize("nbest", [1, 2])
def test_generate_format_is_fairseq_generates_s_and_h_lines(toy, tmp_path, nbest):
    """Base-2 scores printed as fairseq prints them (issue 49, item 8: they were natural logs).

    One sentence at a time on both sides, so that --search fixed (fairseq's
    finalization) computes what SequenceGenerator does, bit for bit.
    """
    from fairseq_stream.bulk import main

    out = tmp_path / "out.txt"
    main([str(a) for a in ["translate", "--input", toy.raw / "test.src", "--output", out, "--path", toy.transformer,
                           "--data", toy.data_bin, "--search", "fixed", "--beam", "5", "--pool", "1", "--cpu",
                           "--no-progress-bar", "--format", "generate", "--option", "nbest={}".format(nbest)]])
    plain = run_plain_fairseq_generate([toy.data_bin, "--path", toy.transformer, "--gen-subset", "test", "--cpu",
                                        "--batch-size", "1", "--required-batch-size-multiple", "1", "--beam", "5",
                                        "--nbest", nbest]).stdout
    ours = printed_lines(out.read_text())
    assert sorted(ours) == list(range(37)) and all(len(lines) == 1 + nbest for lines in ours.values())
    assert ours == printed_lines(plain)


def test_generate_format_prints_sources_as_fairseq_splits_them(toy, tmp_path):
    """A tab inside a line made its S- line one field longer; a whitespace-only line was printed raw."""
    from fairseq_stream.bulk import main

    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    words = toy.raw.joinpath("test.src").read_text().splitlines()[0].split()
    source.write_text("  {}\t{}  \n \t \n{}\n".format(words[0], " ".join(words[1:]), " ".join(words)))
    main([str(a) for a in ["translate", "--input", source, "--output", out, "--format", "generate"]
          + common(toy, "translate")])
    ours = printed_lines(out.read_text())
    assert [lines[0] for lines in ours.values()] == ["S-0\t" + " ".join(words), "S-1\t", "S-2\t" + " ".join(words)]
    assert ours[0][1].split("\t")[2] == ours[2][1].split("\t")[2]  # the same sentence, the same translation


# --- Ctrl-C ----------------------------------------------------------------------------------------

def test_ctrl_c_is_one_line_and_a_rerun_resumes(toy, tmp_path):
    """SIGINT once a chunk is written: one line, exit status 130, no partial file; a rerun skips the chunk."""
    from fairseq_stream.bulk import INTERRUPTED

    source = tmp_path / "big.txt"
    source.write_text(toy.raw.joinpath("train.src").read_text())  # far more than a chunk's work is left
    out, manifests = tmp_path / "out.txt", tmp_path / "out.txt.chunks" / "chunks"
    argv = [sys.executable, "-m", "fairseq_stream.bulk", "translate", "--input", str(source), "--output", str(out)]
    argv += [str(a) for a in common(toy, "translate") if a != "--no-progress-bar"]  # the bar's thread stops too
    # SIGINT as a terminal sends it, even where this test runs with it ignored (a background job).
    proc = subprocess.Popen(argv, cwd=str(REPO), env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while not list(manifests.glob("*.json")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it was interrupted"
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
        proc.wait()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert (proc.returncode, stderr.strip().splitlines()[-1]) == (130, INTERRUPTED)
    names = sorted(p.name for p in manifests.iterdir())
    assert names and not [n for n in names if ".tmp." in n]  # the chunk being written left nothing behind
    done = len([n for n in names if n.endswith(".json")])
    # The same chunks of a shorter input: every chunk written before Ctrl-C is found done.
    lines = source.read_text().splitlines(keepends=True)
    source.write_text("".join(lines[:done * CHUNK]))
    proc = run_tool([sys.executable, "-m", "fairseq_stream.bulk", "translate", "--input", source, "--output", out]
                    + common(toy, "translate"))
    assert "rank 0 translated 0 chunk(s), found {} done".format(done) in proc.stderr


# --- over-long lines -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_input(corpus, tmp_path_factory):  # noqa: F811
    """Six lines, the fourth (line 4 of the file, the second of chunk 1) longer than the toy's 1024 positions."""
    lines = corpus[1][:6]
    lines[3] = " ".join(corpus[1][0].split() * 60)  # 21 words x 60 + EOS: 1261 tokens
    path = tmp_path_factory.mktemp("long") / "long.txt"
    path.write_text("\n".join(lines) + "\n")
    return path, lines


def test_a_long_line_is_named_by_its_line_in_the_file(toy, long_input, tmp_path):
    with pytest.raises(FairseqStreamError) as e:
        bulk_main(toy, "translate", "--input", long_input[0], "--output", tmp_path / "out.txt", chunk_size=3)
    assert str(e.value).startswith("input line 4 has ")
    assert "more than the model's 1024 positions" in str(e.value) and "--long-lines skip" in str(e.value)


def test_long_lines_skip_or_truncate_and_are_counted(toy, long_input, tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO)
    out = tmp_path / "out.txt"
    bulk_main(toy, "translate", "--input", long_input[0], "--output", out, "--long-lines", "skip",
              "--format", "scores", chunk_size=3)
    rows = out.read_text().split("\n")[:-1]
    assert len(rows) == 6 and rows[3] == "nan\t"  # still one line, empty, with no score
    assert all(float(r.split("\t")[0]) < 0 for i, r in enumerate(rows) if i != 3)
    assert capsys.readouterr().err.strip().endswith("; 1 over-long line skipped (empty output lines)")
    # Another --long-lines redoes the chunk with the long line, and only it.
    bulk_main(toy, "translate", "--input", long_input[0], "--output", out, "--long-lines", "truncate",
              "--format", "scores", chunk_size=3)
    assert counts(caplog) == (1, 1)
    truncated = out.read_text().split("\n")[:-1]
    assert truncated[:3] == rows[:3] and truncated[3].split("\t")[1] != ""
    # The redone chunk's other lines: the same translations; the scores up to float noise (another batch).
    again = [r.split("\t") for r in truncated[4:]]
    before = [r.split("\t") for r in rows[4:]]
    assert [t for _, t in again] == [t for _, t in before]
    assert [float(s) for s, _ in again] == pytest.approx([float(s) for s, _ in before], abs=1e-5)
    assert capsys.readouterr().err.strip().endswith("; 1 over-long line truncated")
    # A line without long lines is the same under every mode: nothing is redone for the mode alone.
    bulk_main(toy, "translate", "--input", long_input[0], "--output", out, "--long-lines", "truncate",
              chunk_size=3)
    assert counts(caplog) == (0, 2)


# --- merge in the wrong folder ---------------------------------------------------------------------

def test_merge_says_where_it_looked(toy, corpus, finished, tmp_path):  # noqa: F811
    elsewhere = tmp_path / "elsewhere.txt"
    with pytest.raises(FairseqStreamError) as e:
        bulk_main(toy, "merge", "--input", corpus[0], "--output", elsewhere)
    assert str(e.value) == (
        "no finished chunk in {}: if the translation wrote its chunks elsewhere, give its --work-dir (the "
        "default is OUTPUT.chunks, next to --output)".format(os.path.join(str(elsewhere) + ".chunks", "chunks")))


# --- ranks die with their launcher -----------------------------------------------------------------

def alive(pid):
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        with open("/proc/{}/stat".format(pid)) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_job(toy, source, tmp_path, *extra):
    argv = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "fairseq_stream.bulk", "translate",
            "--input", str(source), "--output", str(tmp_path / "out.txt")] + [
                str(a) for a in common(toy, "translate") + list(extra)]
    env = tool_env()
    env["PATH"] = "{}{}{}".format(os.path.dirname(sys.executable), os.pathsep, env["PATH"])
    return subprocess.Popen(argv, cwd=str(REPO), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def workers_of(launcher, deadline):
    while time.time() < deadline:
        pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                               text=True).stdout.split()]
        if len(pids) == 2:
            return pids
        time.sleep(0.05)
    raise AssertionError("torchrun started no two workers")


def gone_within(pids, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def end(launcher, workers):
    """Clean up after a test that failed: the launcher and its workers, by their ids."""
    launcher.kill()
    launcher.wait()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux")
def test_ranks_die_with_a_killed_torchrun(toy, tmp_path):
    """SIGKILL torchrun once both ranks have joined, and once right as they start: no rank outlives it."""
    source = tmp_path / "big.txt"
    source.write_text(toy.raw.joinpath("train.src").read_text())  # minutes of work for each rank
    # Joined, then stopped (SIGSTOP): a stopped rank runs no code of its own, nor notices a store
    # that is gone; only the kernel's parent-death signal (SIGKILL) can end it.
    launcher, workers = start_job(toy, source, tmp_path, "--chunk-size", "3000"), []
    try:
        workers = workers_of(launcher, time.time() + 60)
        joined, deadline = 0, time.time() + 60
        while joined < 2 and time.time() < deadline:
            joined += "joined the job" in launcher.stderr.readline()
        assert joined == 2, "the ranks did not join"
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        launcher.kill()
        launcher.wait()
        assert gone_within(workers, 10) == [], "ranks outlived their launcher"
    finally:
        end(launcher, workers)
    # At once, while the ranks are still importing: a rank that finds its launcher gone stops, and
    # the start-up timeout bounds any other (where a subreaper, not init, adopted it).
    launcher, workers = start_job(toy, source, tmp_path, "--chunk-size", "3000", "--startup-timeout", "5"), []
    try:
        workers = workers_of(launcher, time.time() + 60)
        launcher.kill()
        launcher.wait()
        assert gone_within(workers, 30) == [], "ranks outlived their launcher"
    finally:
        end(launcher, workers)
