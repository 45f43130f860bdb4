"""``--cpu-workers``: batches decoded at once by forked worker processes (schedule/workers.py, issue 50).

Real decodes of the toy transformer on two workers against one: the same
lines in the same order (bitwise where each batch is decoded on its own, and
in int8 everywhere), every sentence once; the layout and its log line; a
failing or vanished worker stops every worker with one line; Ctrl-C ends the
run with one line and status 130. No timing is asserted.
"""

import collections
import json
import multiprocessing
import os
import signal
import subprocess
import threading
import time

import pytest

from conftest import BIN, REPO, generate_in_process, run_tool, tool_env
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import threads

GENERATE_LINES = ("S-", "T-", "H-", "D-", "P-", "Generate ")  # every sentence's lines, then the BLEU line


def generate(toy, options, workers, subset="valid", extra_env=None, path=None):
    """fairseq-generate's output lines (in its order) and stderr, on ``workers`` CPU workers (``path``: the
    checkpoints, default the toy transformer)."""
    proc = run_tool(["fairseq-generate", toy.data_bin, "--path", path or toy.transformer, "--user-dir",
                     "fairseq_stream", "--gen-subset", subset, "--batch-size", "16", "--cpu", "--cpu-workers",
                     str(workers)] + options,
                    env=dict({"OMP_NUM_THREADS": "2"}, **(extra_env or {})))
    return [line for line in proc.stdout.splitlines() if line.startswith(GENERATE_LINES)], proc.stderr


def hypothesis_ids(lines):
    return [int(line.split("\t")[0][2:]) for line in lines if line.startswith("H-")]


@pytest.mark.parametrize("options", [
    ["--search", "fixed", "--beam", "5", "--runner", "lean"],
    ["--search", "var-batch", "--beam", "5"],
    ["--search", "greedy"],
    ["--search", "jacobi"],
    ["--search", "var-batch", "--beam", "5", "--quantize", "int8"],
    ["--search", "var-stream", "--beam", "5", "--quantize", "int8"],
    ["--search", "var-stream", "--beam", "5", "--quantize", "int8w8"],
    ["--search", "var-stream", "--beam", "5", "--quantize", "int8w7"],
    ["--search", "fixed", "--beam", "5", "--runner", "static"],
], ids=["fixed", "var-batch", "greedy", "jacobi", "int8-var-batch", "int8-var-stream", "int8w8-var-stream",
        "int8w7-var-stream", "static-fixed"])
def test_two_workers_print_one_workers_lines_bit_for_bit(toy, options, tmp_path):
    one, _ = generate(toy, options + ["--stats-file", str(tmp_path / "one.json")], 1)
    two, log = generate(toy, options + ["--stats-file", str(tmp_path / "two.json")], 2)
    assert "2 CPU workers started" in log
    assert two == one
    assert sorted(hypothesis_ids(two)) == list(range(200))
    counts = [json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json")]
    # A stream split into its batches makes other calls (timesteps) of the same expansions.
    for key in ("sentences", "expansions") + (() if "var-stream" in options else ("timesteps",)):
        assert counts[1][key] == counts[0][key], key


def test_two_workers_decode_a_four_member_ensemble_as_one_worker_does(toy, tmp_path):
    # The WMT'19 systems are 4-member ensembles, and int8 takes workers by default: each worker runs every
    # member's step (the lean runner's member-by-member loop) on its own chunks, with one worker's bits.
    members = ":".join(str(p) for p in (toy.transformer, toy.transformer2, toy.transformer3, toy.transformer4))
    options = ["--search", "var-stream", "--beam", "5", "--quantize", "int8"]
    one, _ = generate(toy, options, 1, path=members)
    two, log = generate(toy, options, 2, path=members)
    assert "2 CPU workers started" in log and "4 models" in log
    assert two == one
    assert sorted(hypothesis_ids(two)) == list(range(200))


def test_two_workers_print_what_fairseq_prints_in_one_process(toy, capsys, monkeypatch):
    # The parent's shortcuts (schedule/wire.py: results in columns; token_strings.py: fairseq's
    # Dictionary.string over ints) against one process with fairseq's own Dictionary.string, line for line.
    from fairseq.data.dictionary import Dictionary

    options = ["--search", "fixed", "--beam", "5", "--runner", "lean", "--quantize", "int8"]
    two, _ = generate(toy, options, 2)
    monkeypatch.setattr(Dictionary, "string", Dictionary.string.__wrapped__)
    generate_in_process([toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream", "--gen-subset",
                         "valid", "--batch-size", "16", "--cpu", "--cpu-workers", "1"] + options)
    one = [line for line in capsys.readouterr().out.splitlines() if line.startswith(GENERATE_LINES)]
    assert len(one) == 5 * 200 + 1 and one[-1].startswith("Generate ")
    assert two == one


@pytest.mark.parametrize("search", ["fixed", "var-stream"])
def test_two_workers_print_each_sentences_nbest_hypotheses(toy, search):
    # The workers send back only --nbest hypotheses a sentence (schedule/workers.py: decode_samples).
    options = ["--search", search, "--beam", "5", "--nbest", "3", "--quantize", "int8"]
    one, _ = generate(toy, options, 1, subset="test")
    two, _ = generate(toy, options, 2, subset="test")
    assert two == one
    counts = collections.Counter(hypothesis_ids(two))
    assert sorted(counts) == list(range(37))
    # A variable-width beam may finish fewer hypotheses than --nbest; a fixed one has 5 to print 3 of.
    assert set(counts.values()) == {3} if search == "fixed" else max(counts.values()) == 3


def test_a_float32_stream_split_among_workers_keeps_every_translation(toy):
    # Each worker streams its own batches: other sentences share its calls, so float32 scores may move in
    # the last bits (docs/threads.md); the translations and their order stay.
    options = ["--search", "var-stream", "--beam", "5"]
    one, _ = generate(toy, options, 1)
    two, _ = generate(toy, options, 2)
    hyps = [[line.split("\t") for line in lines if line.startswith("H-")] for lines in (one, two)]
    assert [(h[0], h[2]) for h in hyps[1]] == [(h[0], h[2]) for h in hyps[0]]
    assert all(abs(float(a[1]) - float(b[1])) < 1e-4 for a, b in zip(*hyps))
    assert sorted(hypothesis_ids(two)) == list(range(200))


def test_the_default_layout_takes_workers_only_where_they_change_no_bit(toy):
    run = ["fairseq-generate", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
           "--gen-subset", "test", "--cpu", "--beam", "5", "--search"]
    env = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}  # torch's thread count reads both
    batch = run_tool(run + ["var-batch"], env=env).stderr
    assert "CPU threads: 2 workers decoding batches at once, each with 1 thread for our kernels" in batch
    stream = run_tool(run + ["var-stream"], env=env).stderr
    assert "CPU threads: 2 threads for our kernels, torch's ops on 1 (the 2 cores" in stream
    # int8's products are exact integer sums row by row in every width (int8 resolves to int8w8 or int8w7 by
    # CPU; the other is a user's explicit choice): a stream split among workers keeps one worker's bits
    # (test_two_workers_print_one_workers_lines_bit_for_bit[int8*-var-stream]), so workers are their default too.
    for kind in ("int8", "int8w7"):
        int8_stream = run_tool(run + ["var-stream", "--quantize", kind], env=env).stderr
        assert "CPU threads: 2 workers decoding batches at once, each with 1 thread for our kernels" in int8_stream
        assert "2 CPU workers started" in int8_stream
    one_core = run_tool(run + ["var-batch"], env={"OMP_NUM_THREADS": "1"}).stderr
    assert "CPU threads: 1 thread for our kernels" in one_core and "CPU workers started" not in one_core


def test_fairseq_interactive_takes_workers_by_default_only_where_a_buffer_holds_several_batches(toy):
    # Its default --buffer-size 1 hands out one batch at a time: a worker a core left every core but one idle
    # (the parent decoded each batch on one thread), so that default gives one decoder every core.
    lines = "".join(open(toy.raw / "valid.src").readlines()[:20])
    run = ["fairseq-interactive", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream", "--cpu",
           "--search", "fixed", "--beam", "5", "--quantize", "int8"]
    env = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    one_batch = run_tool(run, input=lines, env=env)
    assert "CPU threads: 2 threads for our kernels, torch's ops on 1 (the 2 cores" in one_batch.stderr
    assert "CPU workers started" not in one_batch.stderr
    several = run_tool(run + ["--buffer-size", "16", "--batch-size", "8"], input=lines, env=env)
    assert "CPU threads: 2 workers decoding batches at once, each with 1 thread for our kernels" in several.stderr
    assert "2 CPU workers started" in several.stderr
    hypotheses = [[line for line in proc.stdout.splitlines() if line.startswith("H-")] for proc in (one_batch, several)]
    assert hypotheses[1] == hypotheses[0] and len(hypotheses[0]) == 20


def test_the_layout_combines_workers_and_threads(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "_torch_threads", lambda: 8)
    assert threads.choose_layout(None, None, workers_by_default=True).workers == 4
    assert (threads.choose_layout(None, None).workers, threads.choose_layout(None, None).kernel_threads) == (1, 4)
    assert threads.choose_layout(2, None, workers_by_default=True) == threads.ThreadLayout(2, 1, "--cpu-threads 2")
    both = threads.choose_layout(None, 2)
    assert (both.workers, both.kernel_threads) == (2, 2)
    assert "2 workers decoding batches at once, each with 2 threads" in both.describe()
    given = threads.choose_layout(3, 2)
    assert (given.workers, given.kernel_threads, given.reason) == (2, 3, "--cpu-workers 2, --cpu-threads 3")
    with pytest.raises(FairseqStreamError, match="--cpu-workers must be a whole number of at least 1, got 0"):
        threads.choose_layout(None, 0)
    many = threads.choose_layout(None, 200)
    assert many.workers == 200 and many.reason.endswith("; more workers than the 4 usable cores take turns on them")


def test_fairseq_generate_refuses_a_bad_worker_count(toy):
    bad = run_tool(["fairseq-generate", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
                    "--gen-subset", "test", "--cpu", "--search", "greedy", "--cpu-workers", "0"], check=False)
    assert bad.returncode != 0
    assert "--cpu-workers must be a whole number of at least 1, got 0" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("search", ["var-batch", "var-stream"])
def test_fairseq_interactive_decodes_a_buffers_batches_on_workers(toy, search):
    lines = "".join(open(toy.raw / "valid.src").readlines()[:100])
    outputs = []
    for workers in ("1", "2"):
        proc = run_tool(["fairseq-interactive", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
                         "--search", search, "--beam", "5", "--cpu", "--buffer-size", "32", "--batch-size", "8",
                         "--cpu-workers", workers], input=lines, env={"OMP_NUM_THREADS": "2"})
        outputs.append([line for line in proc.stdout.splitlines() if line.startswith(("S-", "H-", "D-", "P-"))])
    assert "2 CPU workers started" in proc.stderr
    assert outputs[1] == outputs[0]
    assert hypothesis_ids(outputs[1]) == list(range(100))


def translations(toy, workers, quantize="none", search="var-stream"):
    from fairseq_stream.api import Translator

    lines = open(toy.raw / "valid.src").read().splitlines()
    with Translator(str(toy.transformer), data=str(toy.data_bin), search=search, beam=5, cpu=True,
                    batch_size=16, pool=16, quantize=quantize, cpu_workers=workers) as translator:
        return [(t.index, t.text, t.score, [h["positional_scores"].tolist() for h in t.hypotheses])
                for t in translator.translate(lines)]


def our_workers():
    """This process' live worker processes (other tests may leave a DataLoader's children: not ours)."""
    return [c for c in multiprocessing.active_children() if c.name.startswith("fairseq-stream-worker")]


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_the_api_yields_every_sentence_once_in_input_order(toy, quantize):
    one, two = sorted(translations(toy, 1, quantize)), translations(toy, 2, quantize)
    assert [t[0] for t in two] == list(range(200))
    assert [t[1] for t in two] == [t[1] for t in one]
    if quantize == "int8":  # exact integer sums: the one-worker bits whatever shares a call
        assert two == one
    assert our_workers() == []


def test_the_api_keeps_its_workers_between_calls_until_closed(toy):
    # Forking a loaded model and each worker's first touch of its buffers would otherwise be paid by every call.
    from fairseq_stream.api import Translator

    lines = open(toy.raw / "valid.src").read().splitlines()
    translator = Translator(str(toy.transformer), data=str(toy.data_bin), search="var-stream", beam=5, cpu=True,
                            batch_size=16, pool=16, quantize="int8", cpu_workers=2)
    first = [(t.index, t.text, t.score) for t in translator.translate(lines)]
    workers = sorted(child.pid for child in our_workers())
    assert len(workers) == 2
    second = [(t.index, t.text, t.score) for t in translator.translate(lines)]
    assert sorted(child.pid for child in our_workers()) == workers
    assert second == first and sorted(t[0] for t in first) == list(range(200))
    translator.close()
    assert our_workers() == []
    assert [(t.index, t.text, t.score) for t in translator.translate(lines[:40])] == first[:40]  # forks again
    translator.close()
    assert our_workers() == []


def test_an_api_call_stopped_early_ends_the_workers_and_the_next_call_forks_new_ones(toy):
    from fairseq_stream.api import Translator

    lines = open(toy.raw / "valid.src").read().splitlines()
    with Translator(str(toy.transformer), data=str(toy.data_bin), search="greedy", cpu=True, batch_size=8,
                    pool=8, cpu_workers=2) as translator:
        results = translator.translate(lines)
        next(results)
        results.close()  # tasks of this call are still in flight: they must not reach the next call
        assert our_workers() == []
        texts = {t.index: t.text for t in translator.translate(lines)}
        assert sorted(texts) == list(range(200))
        # Two calls read at once: the second gets workers of its own, ended with it.
        one = translator.translate(lines)
        head = next(one)
        two = {t.index: t.text for t in translator.translate(lines)}
        assert two == texts and len(our_workers()) == 2
        rest = {t.index: t.text for t in one}
        rest[head.index] = head.text
        assert rest == texts
    assert our_workers() == []


def test_an_error_in_a_worker_stops_every_worker_with_one_line(toy):
    from fairseq_stream.api import Translator

    translator = Translator(str(toy.transformer), data=str(toy.data_bin), search="var-batch", beam=5, cpu=True,
                            batch_size=16, pool=16, cpu_workers=2)
    real_open = translator.decoder.open

    def failing_open(net_input, ids=None, **kwargs):
        if ids is not None and 150 in ids.tolist():
            raise ValueError("a bad batch")
        return real_open(net_input, ids=ids, **kwargs)

    translator.decoder.open = failing_open  # before the workers fork: theirs fails too
    lines = open(toy.raw / "valid.src").read().splitlines()
    with pytest.raises(FairseqStreamError, match=r"^CPU worker [12] of 2: ValueError: a bad batch$"):
        list(translator.translate(lines))
    assert our_workers() == []


def test_a_vanished_worker_is_named_in_one_line(toy):
    from fairseq_stream.api import Translator

    translator = Translator(str(toy.transformer), data=str(toy.data_bin), search="greedy", cpu=True,
                            batch_size=8, pool=8, cpu_workers=2)
    lines = open(toy.raw / "valid.src").read().splitlines() * 5
    results = translator.translate(lines)
    next(results)  # the first batch is back; the second worker has batches still to come
    for child in our_workers():
        if child.name.endswith("-1"):
            os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(FairseqStreamError, match=r"CPU worker 2 of 2 stopped \(killed by signal 9\)"):
        list(results)
    assert our_workers() == []


_ctrl_c_in_fork = []  # armed: the next fork's after-fork hook in this process sends SIGINT to it


def _sigint_after_fork():
    if _ctrl_c_in_fork:
        _ctrl_c_in_fork.clear()
        os.kill(os.getpid(), signal.SIGINT)


os.register_at_fork(after_in_parent=_sigint_after_fork)


def test_a_ctrl_c_that_lands_inside_a_fork_is_not_dropped():
    """Inside os.fork, the KeyboardInterrupt came up in logging's after-fork hook, where Python reports
    "Exception ignored" and drops it: the bulk tool (a fork per chunk) then ran on to the end, status 0."""
    from fairseq_stream.schedule.workers import Workers

    # Python's own Ctrl-C, also where this test runs with SIGINT ignored (a background job).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    # Another thread, as a tool has (the encoder's, a progress bar's): the kernel may hand it the signal, so
    # masking SIGINT in the forking thread did not hold it (this test failed so in one CI run of three).
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    _ctrl_c_in_fork.append(True)
    try:
        with pytest.raises(KeyboardInterrupt):
            Workers(2, abs)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    finally:
        _ctrl_c_in_fork.clear()
        signal.signal(signal.SIGINT, before)
        stop.set()
        other.join()
        for child in our_workers():
            child.kill()
            child.join()


def test_ctrl_c_stops_the_workers_with_one_line_and_status_130(toy):
    # Every sentence forced to 150 tokens: the decode runs long enough to be interrupted mid-way.
    argv = [str(BIN / "fairseq-generate"), str(toy.data_bin), "--path", str(toy.transformer), "--user-dir",
            "fairseq_stream", "--gen-subset", "valid", "--batch-size", "8", "--cpu", "--search", "fixed",
            "--beam", "5", "--runner", "lean", "--min-len", "150", "--max-len-b", "150", "--cpu-workers", "2"]
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(tool_env(), OMP_NUM_THREADS="2"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # test_interrupt.py
    seen = ""
    for line in proc.stderr:
        seen += line
        if "CPU workers started" in line:
            break
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, seen + rest
    assert "fairseq-stream: interrupted; the CPU workers are stopped" in rest
    assert "Traceback" not in rest
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no worker outlived the run


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_workers_end_with_a_killed_parent(toy, how):
    """A parent killed runs no cleanup: its workers kept decoding under init, 300 MB each, until killed by hand."""
    argv = [str(BIN / "fairseq-generate"), str(toy.data_bin), "--path", str(toy.transformer), "--user-dir",
            "fairseq_stream", "--gen-subset", "valid", "--batch-size", "8", "--cpu", "--search", "fixed",
            "--beam", "5", "--runner", "lean", "--min-len", "150", "--max-len-b", "150", "--cpu-workers", "2"]
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(tool_env(), OMP_NUM_THREADS="2"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stderr:
        if "CPU workers started" in line:
            workers = [int(p) for p in line.rsplit("(processes", 1)[1].strip(" )\n").split()]
            break
    proc.send_signal(how)  # the parent only, as kill does
    proc.wait(timeout=60)  # not its pipe: workers left alive would hold it open
    proc.stderr.close()
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in workers if os.path.exists("/proc/{}".format(p))
                 and open("/proc/{}/stat".format(p)).read().rsplit(")", 1)[1].split()[0] != "Z"]
    for pid in alive:  # leave nothing behind, whatever the test found
        os.kill(pid, signal.SIGKILL)
    assert alive == []
