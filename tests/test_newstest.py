"""scripts/newstest.sh, newstest_all.sh and report.py end to end, offline, on real (small) checkpoints."""

import json
import os
import re

import pytest

from conftest import REPO, run_tool
from fairseq_stream.newstest import run as newstest
from fairseq_stream.newstest.testset import CorpusError


def toy_model_args(toy, work_dir):
    """newstest.sh options for the toy model: no tokenizer or BPE, its own dictionaries."""
    return ["--models", toy.root, "--checkpoints", "transformer/checkpoint_best.pt",
            "--srcdict", toy.data_bin / "dict.src.txt", "--tgtdict", toy.data_bin / "dict.tgt.txt",
            "--tokenizer", "none", "--bpe", "none", "--work-dir", work_dir, "--cpu"]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    """One --work-dir for the module: the prepared toy input is cached there once."""
    return tmp_path_factory.mktemp("newstest-work")


def test_the_table1_grid_offline_on_the_toy_model(toy, tmp_path, work_dir):
    """Every stage on real decoding: preparation, three methods, D- lines, sacreBLEU, results file, report."""
    texts = tmp_path / "text" / "src-tgt"
    texts.mkdir(parents=True)
    (texts / "newstest0.src").write_text((toy.raw / "test.src").read_text())
    (texts / "newstest0.tgt").write_text((toy.raw / "test.tgt").read_text())
    results, report_dir = tmp_path / "results.jsonl", tmp_path / "report"
    proc = run_tool(["bash", REPO / "scripts" / "newstest_all.sh", "--pairs", "src-tgt", "--year", "0",
                     "--methods", "greedy", "beam", "fixed", "--beams", "5", "--runs", "1",
                     "--text-dir-root", tmp_path / "text", "--results", results, "--report-dir", report_dir,
                     "--limit", "12"] + toy_model_args(toy, work_dir))
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["method"], r["beam"]) for r in rows] == [("greedy", None), ("beam", 5), ("fixed", 5)]
    hyps = {r["method"]: open(r["hypotheses"]).read().splitlines() for r in rows}
    assert all(len(h) == 12 for h in hyps.values())
    # Exactness survives the whole pipeline: fixed gives fairseq's beam search's translations.
    assert hyps["fixed"] == hyps["beam"]
    from sacrebleu.metrics import BLEU

    refs = (toy.raw / "test.tgt").read_text().splitlines()[:12]
    for r in rows:
        assert r["bleu"] == round(BLEU().corpus_score(hyps[r["method"]], [refs]).score, 2)
        assert r["testset"] == "newstest0" and r["sentences"] == 12 and r["device"] == "cpu"
        assert r["decode_s"] is not None and r["wall_s"] > r["decode_s"]
        assert (r["counters"] is None) == (r["method"] == "beam")
    assert rows[0]["counters"]["sentences"] == 12
    table = (report_dir / "report.md").read_text()
    assert "| src-tgt | newstest0 | fixed | {:.2f} |".format(rows[2]["bleu"]) in table
    assert table in proc.stdout
    assert sorted(p.name for p in report_dir.glob("*.png")) == ["bleu_vs_decode_cpu_beam5.png",
                                                                "decode_cpu_beam5.png"]

    # A second grid run into the same files: the results file keeps both runs, the report is the second's.
    again = run_tool(["bash", REPO / "scripts" / "newstest_all.sh", "--pairs", "src-tgt", "--year", "0",
                      "--methods", "greedy", "--runs", "1", "--text-dir-root", tmp_path / "text",
                      "--results", results, "--report-dir", report_dir, "--limit", "12"]
                     + toy_model_args(toy, work_dir))
    rows2 = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows2) == 4 and len({r["grid"] for r in rows2[:3]}) == 1 and rows2[3]["grid"] != rows2[0]["grid"]
    table = (report_dir / "report.md").read_text()
    assert table in again.stdout and "| fixed |" not in table and "| beam |" not in table
    assert "| src-tgt | newstest0 | greedy | {:.2f} | ".format(rows2[3]["bleu"]) in table
    assert "| 1 |" in table.split("| greedy |")[1].splitlines()[0]  # one run, not the first grid's too
    assert sorted(p.name for p in report_dir.glob("*.png")) == ["bleu_vs_decode_cpu_beam-.png",
                                                                "decode_cpu_beam-.png"]


def test_user_errors_are_one_line(toy, tmp_path, work_dir):
    base = ["src-tgt", "0", "greedy"] + [str(a) for a in toy_model_args(toy, work_dir)]
    with pytest.raises(newstest.NewstestError, match=r"unknown METHOD 'int16' \(choose from: beam, fixed"):
        newstest.run(["src-tgt", "0", "int16"] + base[3:])
    with pytest.raises(newstest.NewstestError, match=r"--models wmt19/wmt19.de-en.joined-dict.ensemble: no such "
                       r"directory \(fetch it: scripts/download_wmt19.sh de-en wmt19\)"):
        newstest.run(["de-en", "2018", "beam", "--text-dir", str(tmp_path)])
    with pytest.raises(CorpusError) as e:
        newstest.run(base + ["--text-dir", str(tmp_path)])
    # The path once: "PATH: cannot read input file PATH: ..." named it twice.
    assert str(e.value) == "cannot read input file {}: No such file or directory".format(tmp_path / "newstest0.src")
    bad = tmp_path / "bad.src"
    bad.write_bytes(b"ok\n\xff\n")
    with pytest.raises(CorpusError, match=r"^{}: input line 2 is not valid UTF-8".format(re.escape(str(bad)))):
        newstest.run(base + ["--source", str(bad), "--reference", str(toy.raw / "test.tgt")])
    short = tmp_path / "short.tgt"
    short.write_text("t1\n")
    with pytest.raises(CorpusError, match="test: 37 source lines but 1 reference lines"):
        newstest.run(base + ["--source", str(toy.raw / "test.src"), "--reference", str(short)])
    # --beam 0 ran fairseq-generate, to fail there, with its log named "...k.run1.log".
    for option in ("--beam", "--batch-size", "--runs", "--limit"):
        with pytest.raises(newstest.NewstestError, match="^{} must be at least 1, got 0$".format(option)):
            newstest.run(base + [option, "0"])
    with pytest.raises(newstest.NewstestError, match="--gpu-memory needs --beam 5 or 50"):
        newstest.run(["src-tgt", "0", "beam", "--beam", "7", "--gpu-memory", "16", "--source",
                      str(toy.raw / "test.src"), "--reference", str(toy.raw / "test.tgt"), "--limit", "2"]
                     + base[3:])


def test_a_fairseq_generate_failure_names_its_log(toy, work_dir):
    source = work_dir / "newstest0.src"
    source.write_text((toy.raw / "test.src").read_text())
    with pytest.raises(newstest.NewstestError) as e:
        # The same text and --limit as the grid above: the prepared input comes from the cache.
        newstest.run(["src-tgt", "0", "greedy", "--source", str(source), "--reference", str(toy.raw / "test.tgt"),
                      "--limit", "12"] + [str(a) for a in toy_model_args(toy, work_dir)] + ["--", "--no-such-option"])
    message = str(e.value)
    assert message.startswith("fairseq-generate failed (exit 2): ") and "\n" not in message
    assert "unrecognized arguments: --no-such-option" in message and message.endswith(".log)")


def test_the_wmt19_path_on_newstest_text_with_a_standin(tmp_path, monkeypatch):
    """Defaults as for the real ensembles: model from $WMT19_DIR, Moses + fastBPE, joined dictionary."""
    import importlib.util

    import fastBPE
    from sacremoses import MosesTokenizer

    spec = importlib.util.spec_from_file_location("standin", REPO / "scripts" / "make_wmt19_standin.py")
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    sample = REPO / "tests" / "data" / "wmt" / "de-en"
    models = tmp_path / "wmt19" / "wmt19.de-en.joined-dict.ensemble"
    standin.main(["de-en", str(models), "--tiny", "--models", "2", "--train-text", str(sample / "newstest2016.de"),
                  str(sample / "newstest2016.en")])
    results = tmp_path / "results.jsonl"
    monkeypatch.setenv("WMT19_DIR", str(tmp_path / "wmt19"))
    newstest.run(["de-en", "2018", "var-batch", "--beam", "5", "--text-dir", str(sample), "--limit", "8",
                  "--results", str(results), "--work-dir", str(tmp_path / "work"), "--cpu",
                  "--", "--max-len-a", "1.2", "--max-len-b", "10"])
    row = json.loads(results.read_text())
    assert (row["testset"], row["method"], row["beam"], row["sentences"]) == ("newstest2018", "var-batch", 5, 8)
    assert [os.path.basename(m) for m in row["models"]] == ["model1.pt", "model2.pt"]
    # The binarized input is fairseq's Moses tokenizer (escaping, as tokenizer.perl) then fastBPE.
    raw = (sample / "newstest2018.de").read_text().splitlines()[:8]
    moses = MosesTokenizer(lang="de")
    bpe = fastBPE.fastBPE(str(models / "bpecodes"))
    expected = bpe.apply([moses.tokenize(line, aggressive_dash_splits=True, return_str=True, escape=True)
                          for line in raw])
    prepared = next((tmp_path / "work" / "prepared").glob("newstest2018.de-en.*"))
    assert (prepared / "test.de").read_text().splitlines() == expected
    hyps = open(row["hypotheses"]).read().splitlines()
    assert len(hyps) == 8 and row["counters"]["sentences"] == 8
    from sacrebleu.metrics import BLEU

    refs = (sample / "newstest2018.en").read_text().splitlines()[:8]
    assert row["bleu"] == round(BLEU().corpus_score(hyps, [refs]).score, 2)


# --- scratch folders of interrupted preparations (issue 32) ---------------------------------------

def toy_testset(toy, limit=5):
    from fairseq_stream.newstest.testset import Corpus

    lines = lambda side: (toy.raw / "test.{}".format(side)).read_text().splitlines()[:limit]  # noqa: E731
    return Corpus("newstest0", lines("src"), lines("tgt"), str(toy.raw / "test.src"))


def prepare_toy(toy, work_dir, limit=5):
    from fairseq_stream.newstest import prepare as prep

    return prep.prepare(toy_testset(toy, limit), "src-tgt", prep.Encoding("none", "none"),
                        str(toy.data_bin / "dict.src.txt"), str(toy.data_bin / "dict.tgt.txt"), str(work_dir))


def scratch_folders(work_dir):
    return sorted(p.name for p in (work_dir / "prepared").glob("*.tmp*"))


def test_an_interrupted_preparation_removes_its_scratch_folder(toy, tmp_path, monkeypatch):
    from fairseq_stream.newstest import prepare as prep

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep.subprocess, "run", interrupted)  # Ctrl-C during fairseq-preprocess
    with pytest.raises(KeyboardInterrupt):
        prepare_toy(toy, tmp_path)
    assert (tmp_path / "prepared").is_dir() and scratch_folders(tmp_path) == []


def test_scratch_folders_of_dead_processes_are_removed(toy, tmp_path):
    """What SIGKILL leaves behind goes at the next run; a live process's and another host's stay."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    prepared = tmp_path / "prepared"
    names = {"old.tmp{}".format(dead.pid): False, "x.tmp{}@{}".format(dead.pid, host): False,
             "x.tmp{}@{}".format(os.getppid(), host): True, "x.tmp{}@elsewhere".format(dead.pid): True}
    for name in names:
        (prepared / name / "data-bin").mkdir(parents=True)
    data_bin = prepare_toy(toy, tmp_path)
    assert os.path.isfile(os.path.join(data_bin, "test.src-tgt.src.bin"))
    assert scratch_folders(tmp_path) == sorted(n for n, kept in names.items() if kept)


def test_sigterm_during_preparation_leaves_no_scratch_folder(toy, tmp_path):
    """newstest.sh killed (SIGTERM) while it prepares its input: no prepared/*.tmp* folder is left."""
    import signal
    import subprocess
    import time

    from conftest import tool_env

    args = ["src-tgt", "0", "greedy", "--source", toy.raw / "test.src", "--reference", toy.raw / "test.tgt",
            "--results", tmp_path / "r.jsonl"] + toy_model_args(toy, tmp_path / "work")
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "newstest.sh")] + [str(a) for a in args],
                            env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not scratch_folders(tmp_path / "work") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scratch_folders(tmp_path / "work"), "the preparation never started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err
    assert scratch_folders(tmp_path / "work") == [] and not (tmp_path / "r.jsonl").exists()


# --- the score is the detokenized D- lines', not the H- lines' (issue 32) ------------------------

GENERATE_OUTPUT = """S-1\ts1 s2
H-1\t-0.5\tt1&amp; t2
D-1\t-0.5\tt1& t2
P-1\t-0.1 -0.2 -0.3
S-0\ts3
H-0\t-0.4\tit &apos;s
D-0\t-0.4\tit's
P-0\t-0.1 -0.3
"""


def test_detokenized_reads_the_d_lines_in_sentence_order():
    assert newstest.detokenized(GENERATE_OUTPUT, 2) == ["it's", "t1& t2"]
    with pytest.raises(newstest.NewstestError, match="printed 2 of 3 translations"):
        newstest.detokenized(GENERATE_OUTPUT, 3)


@pytest.fixture(scope="module")
def escaping_toy(toy, tmp_path_factory):
    """The toy transformer with target words that Moses escapes: its H- and D- lines differ.

    Every target word tN is spelled ``tN&apos;`` in the (joined) dictionary:
    the model computes exactly what it did, its H- lines print ``t5&apos;``
    and fairseq's Moses detokenizer turns them into ``t5'`` on its D- lines
    (``&apos;``, unlike ``&amp;``, is not undone by sacreBLEU's 13a
    tokenizer, so the two score differently). The source words (sN) are
    Moses-proof, so the input is unchanged. The reference is the toy's,
    spelled ``tN'`` as a detokenized translation is.
    """
    import re

    root = tmp_path_factory.mktemp("escaping-toy")
    text = (toy.data_bin / "dict.src.txt").read_text()
    (root / "dict.txt").write_text(re.sub(r"^(t\d+) ", r"\1&apos; ", text, flags=re.M))
    (root / "test.tgt").write_text(re.sub(r"(t\d+)", r"\1'", (toy.raw / "test.tgt").read_text()))
    return root


def test_bleu_is_scored_on_the_detokenized_d_lines(toy, escaping_toy, tmp_path):
    from sacrebleu.metrics import BLEU

    results = tmp_path / "r.jsonl"
    newstest.run(["src-tgt", "0", "greedy", "--models", str(toy.root),
                  "--checkpoints", "transformer/checkpoint_best.pt",
                  "--srcdict", str(escaping_toy / "dict.txt"), "--tgtdict", str(escaping_toy / "dict.txt"),
                  "--tokenizer", "moses", "--bpe", "none", "--source", str(toy.raw / "test.src"),
                  "--reference", str(escaping_toy / "test.tgt"), "--limit", "12", "--results", str(results),
                  "--work-dir", str(tmp_path / "work"), "--cpu"])
    row = json.loads(results.read_text())
    out = open(row["hypotheses"].replace(".hyp", ".out")).read()
    lines = lambda tag: [text for _, text in sorted(  # noqa: E731
        (int(line.split("\t")[0][2:]), line.split("\t")[2]) for line in out.splitlines() if line.startswith(tag))]
    hyps, tokenized = lines("D-"), lines("H-")
    assert all("&apos;" in h and "&" not in d and "'" in d for h, d in zip(tokenized, hyps))
    assert open(row["hypotheses"]).read().splitlines() == hyps
    refs = (escaping_toy / "test.tgt").read_text().splitlines()[:12]
    assert row["bleu"] == round(BLEU().corpus_score(hyps, [refs]).score, 2)
    # The H- lines score lower, so that scoring them would fail the line above (0 against 36 to 39 on toys
    # trained on different CPUs; a margin, as this had, would ask the toy, trained per machine, for some BLEU).
    assert row["bleu"] > round(BLEU().corpus_score(tokenized, [refs]).score, 2)


def test_the_default_output_folders_are_not_added_to_the_repository():
    """results/ (newstest.sh, newstest_all.sh), standin/ and wmt19/ (the README's commands) are git-ignored."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["results/newstest_table1.jsonl", "results/table1/report.md", "results/work/prepared/x",
             "standin/wmt19.de-en.joined-dict.ensemble/model1.pt", "wmt19/wmt19.ru-en.ensemble/model1.pt"]
    proc = subprocess.run(["git", "check-ignore", "--no-index"] + paths, cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.split() == paths
    assert run_default("--results") == "results/newstest.jsonl" and run_default("--work-dir") == "results/work"


def run_default(option):
    return next(a.default for a in newstest.parser()._actions if option in a.option_strings)


@pytest.mark.parametrize("extra, says", [
    (["--models", "/nonexistent/dir"], "--models /nonexistent/dir: no such directory"),
    (["--wmt19-dir", "/nonexistent"], "--wmt19-dir /nonexistent: no such directory"),
    (["--runs", "0"], "--runs must be at least 1, got 0"),
    (["--pairs", "de"], "--pairs de: give SRC-TGT language codes, e.g. de-en"),
    (["--beams", "0"], "--beams must be at least 1, got 0"),
])
def test_the_grid_says_a_bad_shared_option_once_before_any_run(tmp_path, extra, says):
    """Each was the same failure in every one of the grid's 14 cells (29 lines), or cells labelled k=0."""
    proc = run_tool(["bash", REPO / "scripts" / "newstest_all.sh", "--results", tmp_path / "r.jsonl",
                     "--report-dir", tmp_path / "report"] + extra, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].startswith("newstest_all.sh: error: " + says)
    assert not (tmp_path / "r.jsonl").exists()
