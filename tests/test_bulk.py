"""Bulk translation (``fairseq-stream-bulk``, ``torchrun -m fairseq_stream.bulk``) on the toy transformer.

Real runs: the toy checkpoint, torchrun with two CPU ranks on gloo, chunk
files on disk. Checked: the merged output equals the Python API's
translations in input order (empty lines and a last line without a newline
included); two ranks give the same file as one and both take chunks; a
re-run redoes exactly the missing, corrupt, altered and stale chunks; other settings
redo everything; merge in every format; one-line errors.
"""

import json
import math
import os
import sys

import pytest

from conftest import REPO, run_tool
from fairseq_stream.bulk import chunks

SENTENCES = 70
CHUNK = 16  # 5 chunks, the last one short


@pytest.fixture(scope="module")
def corpus(toy, tmp_path_factory):
    """The first toy valid sentences with an empty line inside and no newline at the end."""
    lines = toy.raw.joinpath("valid.src").read_text().splitlines()[:SENTENCES - 1]
    lines.insert(20, "")
    path = tmp_path_factory.mktemp("bulk") / "input.txt"
    path.write_text("\n".join(lines))  # no final newline
    return path, lines


@pytest.fixture(scope="module")
def expected(toy, corpus):
    """The Python API's best translations of the corpus, in input order."""
    from fairseq_stream.api import Translator

    translator = Translator([str(toy.transformer)], data=str(toy.data_bin), search="var-stream", beam=5,
                            pool=16, cpu=True)
    out = {t.index: (t.text, t.score) for t in translator.translate(corpus[1])}
    return [out[i] for i in range(len(corpus[1]))]


def bulk(toy, *args, ranks=1, check=True):
    """Run the command (under torchrun for several ranks); the CompletedProcess."""
    common = ["--path", toy.transformer, "--data", toy.data_bin, "--chunk-size", CHUNK]
    if args[0] == "translate":
        common += ["--cpu", "--pool", "16", "--no-progress-bar"]
    argv = ["-m", "fairseq_stream.bulk"] + [str(a) for a in args] + [str(c) for c in common]
    if ranks > 1:
        argv = ["torchrun", "--standalone", "--nproc-per-node", str(ranks)] + argv
    else:
        argv = [sys.executable] + argv
    return run_tool(argv, check=check)


def translated(proc):
    """{rank: (chunks translated, chunks found done)} from the ranks' log lines."""
    out = {}
    for line in proc.stderr.splitlines():
        if "fairseq-stream bulk: rank" in line:
            words = line.split("fairseq-stream bulk: rank ")[1].split()
            out[int(words[0])] = (int(words[2]), int(words[5]))
    return out


def test_one_rank_writes_every_line_in_input_order(toy, corpus, expected, tmp_path):
    out = tmp_path / "out.txt"
    proc = bulk(toy, "translate", "--input", corpus[0], "--output", out)
    assert out.read_text().split("\n")[:-1] == [text for text, _ in expected]
    assert translated(proc) == {0: (5, 0)}
    assert expected[20][0] == ""  # the empty line's translation is empty, and still a line


def test_two_ranks_share_the_chunks_and_write_the_same_file(toy, corpus, expected, tmp_path):
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    bulk(toy, "translate", "--input", corpus[0], "--output", one, "--format", "scores")
    proc = bulk(toy, "translate", "--input", corpus[0], "--output", two, "--format", "scores", ranks=2)
    counts = translated(proc)
    # Which rank takes how many chunks is a race (a rank that loads its model first may take all
    # five toy chunks): that they share the counter is test_workers_share_one_counter's.
    assert sorted(counts) == [0, 1] and sum(c[0] for c in counts.values()) == 5
    assert two.read_bytes() == one.read_bytes()
    rows = [line.split("\t", 1) for line in two.read_text().split("\n")[:-1]]
    assert [text for _, text in rows] == [text for text, _ in expected]
    # The API decoded all 70 lines in one pool, the ranks 16 at a time: float32 products over other
    # row counts round differently (up to ~2e-6 measured on a retrained toy model), hence 1e-5.
    assert [float(s) for s, _ in rows] == pytest.approx([s for _, s in expected], abs=1e-5)


def test_workers_share_one_counter(toy, corpus, expected, tmp_path):
    """Two ranks' workers on one store take disjoint chunks, in a fixed order rather than a race."""
    from fairseq_stream.api import Translator
    from fairseq_stream.bulk import job

    translator = Translator([str(toy.transformer)], data=str(toy.data_bin), search="var-stream", beam=5,
                           pool=16, cpu=True)
    index = chunks.index_input(str(corpus[0]), CHUNK)
    os.makedirs(tmp_path / "chunks")
    first, second = job.Ranks(use_cuda=False), job.Ranks(use_cuda=False)
    second.store = first.store  # what torchrun's store is to two processes
    workers = [job._Worker(r, index, str(tmp_path), "settings", translator, "error") for r in (first, second)]
    assert workers[0].take_one()  # chunk 0
    workers[1].work()  # chunks 1-4
    assert not workers[0].take_one()
    assert [(w.done, w.skipped) for w in workers] == [(1, 0), (4, 0)]
    out = tmp_path / "out.txt"
    chunks.merge(index, str(tmp_path), "settings", str(out), "text")
    assert out.read_text().split("\n")[:-1] == [text for text, _ in expected]


def test_fewer_lines_than_ranks(toy, corpus, tmp_path):
    small = tmp_path / "one_line.txt"
    small.write_text(corpus[1][0] + "\n")
    out = tmp_path / "out.txt"
    proc = bulk(toy, "translate", "--input", small, "--output", out, ranks=2)
    assert sorted(translated(proc).values()) == [(0, 0), (1, 0)]
    assert len(out.read_text().split("\n")) == 2 and out.read_text().endswith("\n")


def test_a_rank_killed_mid_run_loses_nothing_on_rerun(toy, corpus, tmp_path):
    """SIGKILL one of two ranks once some chunks are written; torchrun stops the job; a re-run completes it."""
    import signal
    import subprocess
    import time

    from conftest import tool_env

    reference = tmp_path / "reference.txt"
    bulk(toy, "translate", "--input", toy.raw / "valid.src", "--output", reference)
    out = tmp_path / "out.txt"
    work = tmp_path / "out.txt.chunks" / "chunks"
    job = ["-m", "fairseq_stream.bulk", "translate", "--input", str(toy.raw / "valid.src"), "--output", str(out),
           "--path", str(toy.transformer), "--data", str(toy.data_bin), "--chunk-size", "2", "--cpu",
           "--pool", "2", "--no-progress-bar"]
    launcher = subprocess.Popen(["torchrun", "--standalone", "--nproc-per-node", "2"] + job, cwd=str(REPO),
                                env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (work.is_dir() and any(work.glob("*.json"))):
            time.sleep(0.01)
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert workers, "no rank was running"
        os.kill(workers[-1], signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not out.exists()
    written = len(list(work.glob("*.json")))
    assert 0 < written < 100, "the kill came too late to test anything ({} chunks written)".format(written)
    proc = run_tool([sys.executable] + job)  # the same job, one process
    assert translated(proc)[0][1] == written  # every chunk written before the kill is kept
    assert out.read_bytes() == reference.read_bytes()


def test_rerun_redoes_only_missing_corrupt_and_stale_chunks(toy, corpus, expected, tmp_path):
    out = tmp_path / "out.txt"
    work = tmp_path / "out.txt.chunks" / "chunks"
    bulk(toy, "translate", "--input", corpus[0], "--output", out)
    first = out.read_text()
    (work / "0000001.jsonl").unlink()  # a rank died before writing it
    (work / "0000002.jsonl").write_text('{"text": "half a chun')  # a partial write
    manifest = json.loads((work / "0000003.json").read_text())
    manifest["settings_sha256"] = "0" * 64  # written by a run with other settings
    (work / "0000003.json").write_text(json.dumps(manifest))
    untouched = {p: p.stat().st_mtime_ns for p in (work / "0000000.jsonl", work / "0000004.jsonl")}
    proc = bulk(toy, "translate", "--input", corpus[0], "--output", out)
    assert translated(proc) == {0: (3, 2)}
    assert out.read_text() == first
    assert all(p.stat().st_mtime_ns == t for p, t in untouched.items())
    # Other settings: nothing from before is reused.
    proc = bulk(toy, "translate", "--input", corpus[0], "--output", out, "--beam", "2")
    assert translated(proc) == {0: (5, 0)}


def test_a_chunk_altered_after_it_was_written_is_redone(toy, corpus, tmp_path):
    """Its manifest's output hash, not only its line count, decides: same lines, other text: redone."""
    out = tmp_path / "out.txt"
    work = tmp_path / "out.txt.chunks" / "chunks"
    bulk(toy, "translate", "--input", corpus[0], "--output", out)
    first = out.read_text()
    records = [json.loads(line) for line in (work / "0000002.jsonl").read_text().splitlines()]
    records[0]["text"] = "not what the model said"
    (work / "0000002.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))  # as many lines
    proc = bulk(toy, "merge", "--input", corpus[0], "--output", tmp_path / "merged.txt", "--work-dir",
                str(out) + ".chunks", check=False)
    assert proc.returncode == 1 and "(chunk 2)" in proc.stderr.strip().splitlines()[-1]
    proc = bulk(toy, "translate", "--input", corpus[0], "--output", out)
    assert translated(proc) == {0: (1, 4)}
    assert out.read_text() == first


def test_merge_formats_and_missing_chunks(toy, corpus, expected, tmp_path):
    out = tmp_path / "out.txt"
    bulk(toy, "translate", "--input", corpus[0], "--output", out)
    generate = tmp_path / "out.generate"
    bulk(toy, "merge", "--input", corpus[0], "--output", generate, "--work-dir", str(out) + ".chunks",
         "--format", "generate")
    lines = generate.read_text().split("\n")[:-1]
    assert len(lines) == 2 * SENTENCES
    assert lines[0] == "S-0\t" + corpus[1][0]
    head, score, text = lines[1].split("\t")
    # fairseq-generate's H- score: base 2 (tests/test_bulk_edges.py compares the lines with its own)
    assert head == "H-0" and text == expected[0][0]
    assert float(score) == pytest.approx(expected[0][1] / math.log(2), abs=1e-5)
    os.unlink(str(out) + ".chunks/chunks/0000004.json")
    proc = bulk(toy, "merge", "--input", corpus[0], "--output", tmp_path / "again.txt", "--work-dir",
                str(out) + ".chunks", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "fairseq-stream: error: 1 of 5 chunks in {}.chunks/chunks are not done for this input and these "
        "settings (chunk 4); run the translation again with the same options to finish them".format(out))
    assert not (tmp_path / "again.txt").exists()


def test_bad_input_is_a_one_line_error(toy, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"s1 s2\n" * 20 + b"s3 \xff s4\n")
    proc = bulk(toy, "translate", "--input", bad, "--output", tmp_path / "out.txt", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "fairseq-stream: error: input line 21 is not valid UTF-8 (byte 0xff at byte offset 3 of the line)")
    proc = bulk(toy, "translate", "--input", tmp_path / "none.txt", "--output", tmp_path / "out.txt", check=False)
    assert proc.returncode == 1 and "cannot read input file" in proc.stderr.strip().splitlines()[-1]


def test_index_cuts_chunks_at_line_boundaries(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"a\n\nbb\nccc")
    index = chunks.index_input(str(path), 2)
    assert index.lines == 4 and index.offsets == [0, 3, 9]
    assert chunks.read_chunk(index, 0)[1] == ["a", ""]
    assert chunks.read_chunk(index, 1)[1] == ["bb", "ccc"]
    path.write_bytes(b"")
    assert chunks.index_input(str(path), 2).chunks == 0
