"""The encoder running ahead in its own thread (``--encoder-queue``) and maxi-batching (``maxi_batch``).

The thread must change nothing that is decoded, lose or repeat no sentence,
keep memory bounded by its queue, surface an error from either side with its
original traceback and leave no thread behind: at the end, on an error, on
KeyboardInterrupt and when the consumer stops early.
"""

import itertools
import threading
import time
import traceback

import pytest

from conftest import generate_in_process, hypotheses
from fairseq_stream.schedule.read_ahead import ReadAhead, read_ahead


def encoder_threads():
    return [t for t in threading.enumerate() if t.name == "fairseq-stream-encoder" and t.is_alive()]


@pytest.fixture(autouse=True)
def no_thread_left():
    yield
    deadline = time.time() + 5
    while encoder_threads() and time.time() < deadline:
        time.sleep(0.01)
    assert encoder_threads() == []


def test_every_item_once_in_order_and_the_thread_ends():
    ahead = ReadAhead(iter(range(100)), 3)
    assert list(ahead) == list(range(100))
    assert not ahead.alive


def test_the_queue_bounds_how_far_the_producer_runs():
    produced = []

    def source():
        for i in itertools.count():
            produced.append(i)
            yield i

    with ReadAhead(source(), 2) as ahead:
        assert next(ahead) == 0
        time.sleep(0.3)
        # The queue holds 2, one more may be waiting to be put.
        assert len(produced) <= 1 + 2 + 1


def explode_at(n):
    for i in range(10):
        if i == n:
            raise ValueError("boom at {}".format(i))
        yield i


def test_a_producer_error_surfaces_with_its_traceback():
    got = []
    with pytest.raises(ValueError, match="boom at 4") as err:
        for x in read_ahead(explode_at(4), 2):
            got.append(x)
    assert got == [0, 1, 2, 3]
    assert "explode_at" in [frame.name for frame in traceback.extract_tb(err.value.__traceback__)]


def test_a_consumer_that_stops_early_stops_the_thread():
    ahead = ReadAhead(itertools.count(), 2)
    assert [next(ahead) for _ in range(3)] == [0, 1, 2]
    ahead.close()
    assert not ahead.alive
    gen = read_ahead(itertools.count(), 2)
    assert next(gen) == 0
    gen.close()  # a generator closed (or collected) mid-stream


def test_the_producer_runs_in_the_consumers_grad_and_inference_modes():
    import torch

    def modes():
        while True:
            yield torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    with torch.no_grad():
        with ReadAhead(modes(), 1) as ahead:
            assert next(ahead) == (False, False)
    with torch.inference_mode():
        with ReadAhead(modes(), 1) as ahead:
            assert next(ahead) == (False, True)
    with ReadAhead(modes(), 1) as ahead:
        assert next(ahead) == (True, False)


def test_queue_size_zero_is_no_thread():
    assert list(read_ahead(iter(range(5)), 0)) == list(range(5))


def test_the_default_queue_follows_the_free_cores(monkeypatch):
    """The encoder thread runs where the process leaves a core free: its affinity's cores against torch's
    threads and our kernels' (the CPU layout sets torch's to one and gives ours the cores)."""
    import torch

    from fairseq_stream.ops import threads
    from fairseq_stream.schedule.read_ahead import AUTO_QUEUE, encoder_queue_for

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "kernel_threads", lambda: 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert encoder_queue_for(None, "cpu") == AUTO_QUEUE
    assert encoder_queue_for(0, "cpu") == 0 and encoder_queue_for(5, "cpu") == 5
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert encoder_queue_for(None, "cpu") == 0
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(threads, "kernel_threads", lambda: 2)  # --cpu-threads 2: our kernels take both cores
    assert encoder_queue_for(None, "cpu") == 0
    monkeypatch.setattr(threads, "kernel_threads", lambda: 1)
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)  # taskset to one core of two
    assert encoder_queue_for(None, "cpu") == 0
    assert encoder_queue_for(None, "cuda") == 0  # not measured on a GPU yet


def test_tensors_in_finds_a_cohorts_tensors_once(loaded):
    """What the CUDA handoff records on the decoder's stream: every tensor of a cohort, its runner state's too."""
    import torch

    from conftest import sorted_batches
    from fairseq_stream.decoder import BeamDecoder
    from fairseq_stream.schedule.read_ahead import tensors_in

    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, beam_size=5, runner="lean", keep_reference=False)
    cohort = dec.open(sorted_batches(task, 4, 100)[0]["net_input"])
    found = list(tensors_in(cohort))
    assert len({id(t) for t in found}) == len(found)
    segment = cohort.state.segments[0]
    expected = [cohort.tokens, cohort.scores, cohort.ids, segment.caches[0], segment.row_sentence,
                segment.encoder[0].keys[0], segment.encoder[0].values[-1]]
    assert all(any(t is e for t in found) for e in expected)
    assert not any(t is p for p in models[0].parameters() for t in found)
    assert all(isinstance(t, torch.Tensor) for t in found)


def test_on_cuda_the_producer_runs_on_its_own_stream():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")

    def produced():
        for i in range(20):
            # A long kernel on the producer's stream, then a value the consumer must see finished.
            x = torch.full((2048, 2048), float(i), device=device)
            yield (torch.cuda.current_stream(device), (x @ x)[0, 0] / 2048 / i if i else x[0, 0])

    consumer = torch.cuda.current_stream(device)
    with ReadAhead(produced(), 2, device=device) as ahead:
        for i, (stream, value) in enumerate(ahead):
            assert stream != consumer
            # A value read before the producer's kernel finished would be 0 or garbage. Not == i: the
            # H100's cuBLAS (torch 2.11, CUDA 13) gave 7.0000005 for i = 7, which the product's
            # integers do not explain; its rounding is cuBLAS's business, the stream order is ours.
            assert abs(float(value) - i) < 1e-3


def test_on_cuda_the_encoder_thread_changes_no_translation(toy, lines):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fairseq_stream.api import Translator

    def run(**options):
        t = Translator([str(toy.transformer)], data=str(toy.data_bin), search="greedy", pool=8, batch_size=8,
                       **options)
        return sorted((x.index, x.text) for x in t.translate(lines))

    assert run(encoder_queue=2) == run(encoder_queue=0)


# -- decoding ----------------------------------------------------------------


def printed(toy, capsys, *args):
    generate_in_process([toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
                         "--gen-subset", "test", "--batch-size", "8", "--cpu"] + list(args))
    return {sid: text for sid, (_, text) in hypotheses(capsys.readouterr().out).items()}


@pytest.mark.parametrize("search", [("greedy",), ("fixed", "--beam", "5")])
def test_topup_with_the_encoder_thread_prints_what_batch_prints(toy, capsys, search):
    ref = printed(toy, capsys, "--search", *search)
    ours = printed(toy, capsys, "--search", *search, "--generator", "topup", "--stream-pool", "8",
                   "--encoder-queue", "2")
    assert len(ours) == 37 and ours == ref


def translator(toy, **options):
    from fairseq_stream.api import Translator

    return Translator([str(toy.transformer)], data=str(toy.data_bin), search="greedy", cpu=True, pool=8,
                      batch_size=8, **options)


@pytest.fixture(scope="module")
def lines(toy):
    # 37 sentences (not a multiple of the batch of 8), an empty line among them.
    text = (toy.raw / "test.src").read_text().splitlines()
    return text[:20] + [""] + text[20:]


def test_maxi_batching_and_the_encoder_thread_change_no_translation(toy, lines):
    mini = [(t.index, t.text) for t in translator(toy).translate(lines)]
    assert sorted(i for i, _ in mini) == list(range(len(lines)))
    for options in (dict(maxi_batch=4), dict(maxi_batch=100, encoder_queue=2), dict(encoder_queue=1)):
        ours = [(t.index, t.text) for t in translator(toy, **options).translate(lines)]
        assert sorted(ours) == sorted(mini), options
    assert dict(mini)[20] == ""


def test_maxi_batch_sorts_within_its_window_only(toy, lines):
    seen = []
    t = translator(toy, maxi_batch=2)
    original = t._encode_batch

    def recording(chunk, sources):
        seen.append([index for index, _, _ in chunk])
        return original(chunk, sources)

    t._encode_batch = recording
    list(t.translate(lines))
    windows = [sorted(seen[i] + seen[i + 1]) if i + 1 < len(seen) else sorted(seen[i]) for i in range(0, len(seen), 2)]
    assert windows == [list(range(16 * w, min(16 * w + 16, len(lines)))) for w in range(len(windows))]
    seen.clear()
    t = translator(toy, maxi_batch=1)
    t._encode_batch = recording
    list(t.translate(lines))
    assert [i for chunk in seen for i in chunk] == list(range(len(lines)))  # input order


def test_an_encoder_error_mid_run_surfaces_and_no_thread_is_left(toy, lines):
    t = translator(toy, encoder_queue=2)
    original = t.decoder.open
    calls = []

    def failing_open(net_input, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("encoder failed on batch 3")
        return original(net_input, **kwargs)

    t.decoder.open = failing_open
    with pytest.raises(RuntimeError, match="encoder failed on batch 3") as err:
        list(t.translate(lines))
    assert "failing_open" in [f.name for f in traceback.extract_tb(err.value.__traceback__)]


def test_keyboard_interrupt_while_decoding_stops_the_encoder_thread(toy, lines):
    t = translator(toy, encoder_queue=2)
    original = t.decoder.call_model
    calls = []

    def interrupted(cohorts):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return original(cohorts)

    t.decoder.call_model = interrupted
    with pytest.raises(KeyboardInterrupt):
        list(t.translate(lines))


def test_encoder_queue_and_maxi_batch_are_checked(toy):
    from fairseq_stream.errors import FairseqStreamError

    with pytest.raises(FairseqStreamError, match="maxi_batch must be at least 1"):
        translator(toy, maxi_batch=0)
    with pytest.raises(FairseqStreamError, match="--encoder-queue must be >= 0"):
        translator(toy, encoder_queue=-1)


# -- fairseq-generate's --maxi-batch ----------------------------------------------


def test_maxi_batched_windows():
    import numpy as np

    from fairseq_stream.schedule.maxi_batch import reordered as maxi_batched

    by_length = np.array([5, 2, 9, 0, 7, 1, 8, 3, 6, 4])  # fairseq's length-sorted ids
    # m = 1: batches of consecutive input positions (in length order inside a batch, as the collater sorts).
    one = maxi_batched(by_length, 1, 2).tolist()
    assert [sorted(one[i:i + 2]) for i in range(0, 10, 2)] == [[i, i + 1] for i in range(0, 10, 2)]
    # Windows of 2 x 2 input positions, each in fairseq's length order.
    assert maxi_batched(by_length, 2, 2).tolist() == [2, 0, 1, 3, 5, 7, 6, 4, 9, 8]
    assert sorted(maxi_batched(by_length, 100, 8).tolist()) == list(range(10))


def test_generate_maxi_batch_1_keeps_input_order(toy, capsys, monkeypatch):
    from fairseq.data import data_utils

    # The parse sets --maxi-batch on the batching patch: restored after the test.
    monkeypatch.setattr(data_utils.batch_by_size, "maxi_batch", None)
    full = printed(toy, capsys, "--search", "greedy")
    generate_in_process([toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
                         "--gen-subset", "test", "--batch-size", "8", "--cpu", "--search", "greedy",
                         "--maxi-batch", "1"])
    out = capsys.readouterr().out
    order = [int(line.split("\t")[0][2:]) for line in out.splitlines() if line.startswith("H-")]
    assert [sorted(order[i:i + 8]) for i in range(0, len(order), 8)] == \
        [list(range(i, min(i + 8, 37))) for i in range(0, 37, 8)]
    assert {sid: text for sid, (_, text) in hypotheses(out).items()} == full
