"""``--cpu-workers N``: N batches decoded at once by forked worker processes (CTranslate2's inter_threads).

Why processes, not threads. A decode on our runners spends part of its time
in Python (the search loop between decoder calls, building hypotheses),
which holds the GIL; our compiled calls and torch's operators release it.
Measured on the toy transformer (docs/threads.md, "Several batches at
once"): the compiled greedy and beam loops run 72-87% of a batch's time
without the GIL, but var-batch's Python loop only about 41% of it, so two
threads could not decode two var-batch batches at twice the rate of one.
Forked processes share nothing but the weights (copy-on-write: they are
never written after loading) and hold a GIL each; a batch is a few
kilobytes of token ids in and of hypotheses out.

What is exact. Each worker has its own decoder state (its own copy of the
process, forked after the decoder was built) and decodes whole batches, one
``generate`` call each, exactly as one process decodes them: where every
batch is decoded on its own (``--generator batch``: fixed, var-batch, greedy,
Jacobi; every sample of fairseq-interactive), the outputs are the one-worker
outputs bit for bit. A stream across batches (var-stream, ``--generator
stream``/``fifo``/``topup`` in fairseq-generate, the Python API's pool) is
split into its batches, each streamed by one worker with a pool of its own:
the same searches and translations, but a decoder call then holds other
sentences, and float32 products move in the last bits with the rows that
share a call (as with another ``--batch-size``); int8's products are exact
integer sums and give the one-worker bits. So workers are the default only
where each batch is decoded on its own, or in int8
(build.workers_change_no_bit).

Why one batch a task, where a stream would refill across several: the
workers' share of the work, not the refill, decides the time. Tasks of 4
batches (until 2026-12-05) left 4 tasks for 16 batches, and in a decode
sorted by length the last is the longest, so one worker decoded it while the
other had finished: int8 var-stream k=5, the Multi30k model's 1,000 test
sentences sorted by length on two workers, the Python API took 1.94 s in
tasks of 4 batches and 1.62-1.70 s in tasks of one; the tasks' own time was
the same (2.96 s in all), the refill saving nothing measurable;
fairseq-generate's window went from 1.92 to 1.77 s (docs/threads.md).

Results come back in input order: the next free worker takes the next task
(so a worker beside a busy process takes fewer), the parent keeps at most
:data:`WINDOW_PER_WORKER` tasks a worker in flight and answers in the order
it handed them out. A task is decoded from a fresh state (a batch, with a
pool of its own where the search streams), so which worker takes it changes
no bit. An error in a worker stops every worker and is raised in the parent
as one line; Ctrl-C reaches the parent only (the
workers ignore SIGINT) and ends every worker; the command-line tools then
exit with one line and status 130, as the bulk tool does.
"""

import atexit
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from fairseq_stream import interrupt
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.inference_mode import decoding, released
from fairseq_stream.parent_death import die_with_parent
from fairseq_stream.schedule.wire import from_wire, to_wire
from fairseq_stream.schedule.wrapper import DecoderWrapper

logger = logging.getLogger(__name__)

# Tasks handed out ahead per worker: one decoding, one waiting, so that no worker waits for the parent.
WINDOW_PER_WORKER = 2
# Seconds between checks that every worker is still alive while the parent waits.
_POLL_S = 0.2
STOPPED = "; the CPU workers are stopped"  # what Ctrl-C's line adds while they run


class Workers:
    """``n`` forked processes running ``decode(payload)`` on the payloads of :meth:`map`, in order.

    ``decode`` runs in the workers, on what the process held when they were
    forked (the built decoder, the models); payloads and results are pickled
    (token ids, hypotheses). ``stats``: the decoder's counters; each worker's
    additions are added to the parent's as its results arrive.
    """

    def __init__(self, n: int, decode: Callable[[Any], Any], stats=None):
        context = multiprocessing.get_context("fork")
        self.n = n
        self.stats = stats
        self._results = context.Queue()
        self._tasks = context.Queue()  # every worker takes the next task when it is free
        self._tasks.cancel_join_thread()  # at exit, workers that are gone read no more: do not wait for them
        self._processes = []
        with interrupt.sigint_held():  # a Ctrl-C inside a fork is otherwise dropped; held, it comes after
            for index in range(n):
                process = context.Process(target=_serve, args=(index, self._tasks, self._results, decode,
                                                               stats, os.getpid()),
                                          name="fairseq-stream-worker-{}".format(index), daemon=True)
                process.start()
                self._processes.append(process)
        logger.info("fairseq-stream: %d CPU workers started (processes %s)", n,
                    " ".join(str(p.pid) for p in self._processes))
        self._closed = False
        self._sent = 0  # tasks handed out
        atexit.register(_close_if_alive, weakref.ref(self))

    def map(self, payloads: Iterable) -> Iterator:
        """``decode(payload)`` of each payload, in order; payloads are read only a window ahead.

        The next free worker takes the next task: a task is decoded from a fresh state (a batch, streamed
        by a pool of its own where the search streams), so which worker decodes it changes nothing.
        """
        items = iter(payloads)
        done, keys, exhausted = {}, deque(), False
        window = WINDOW_PER_WORKER * self.n
        while True:
            while not exhausted and len(keys) < window:
                payload = next(items, _END)
                if payload is _END:
                    exhausted = True
                    break
                keys.append(self._sent)
                self._tasks.put(pickle.dumps((self._sent, to_wire(payload)), pickle.HIGHEST_PROTOCOL))
                self._sent += 1
            if not keys:
                return
            while keys[0] not in done:
                key, result = self._receive()
                done[key] = result
            yield done.pop(keys.popleft())

    def _receive(self):
        """The next (task, result) from any worker; one-line errors for a failed or vanished worker."""
        while True:
            try:
                message = self._results.get(timeout=_POLL_S)
                break
            except queue.Empty:
                gone = self._gone()
                if gone is None:
                    continue
            try:  # a worker that failed puts its error before it exits: read that rather than its exit
                message = self._results.get(timeout=1.0)
                break
            except queue.Empty:
                raise gone from None
        key, index, kind, value, counters = pickle.loads(message)
        if kind == "error":
            raise FairseqStreamError("CPU worker {} of {}: {}".format(index + 1, self.n, value))
        add_counters(self.stats, counters)
        return key, from_wire(value)

    def _gone(self) -> Optional[FairseqStreamError]:
        """The error for a worker that has exited, or None while every worker runs."""
        for index, process in enumerate(self._processes):
            code = process.exitcode
            if code is not None:
                how = "killed by signal {}".format(-code) if code < 0 else "exit status {}".format(code)
                return FairseqStreamError("CPU worker {} of {} stopped ({}) before it finished its batches; out "
                                          "of memory? run with fewer --cpu-workers".format(index + 1, self.n, how))
        return None

    def close(self, wait: bool = True):
        """End every worker: ask them to stop and wait (``wait``), then end any left (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if wait:
            for _ in self._processes:
                self._tasks.put(None)
            deadline = time.monotonic() + 10.0
            for process in self._processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.terminate()
            process.join()
        self._results.close()
        self._results.cancel_join_thread()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        self.close(wait=exc_type is None)
        return False


_END = object()


def _close_if_alive(ref):
    workers = ref()
    if workers is not None:
        workers.close(wait=False)


def _serve(index: int, inbox, results, decode, stats, parent: int):
    """A worker's loop: decode each task of ``inbox`` and put its result (or its error) in ``results``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the workers
    # A parent killed (SIGTERM, SIGKILL, the OOM killer) runs no cleanup: its workers kept running under init,
    # each holding its memory, waiting for tasks that never came.
    if not die_with_parent(parent):
        os._exit(1)
    while True:
        message = inbox.get()
        if message is None:
            return
        key, payload = pickle.loads(message)
        before = counters_of(stats)
        try:
            result = to_wire(decode(from_wire(payload)))
        except BaseException as e:  # noqa: B902  (every failure goes to the parent as one line)
            detail = str(e) if isinstance(e, FairseqStreamError) else "{}: {}".format(type(e).__name__, e)
            results.put(pickle.dumps((key, index, "error", detail, None)))
            return
        results.put(pickle.dumps((key, index, "ok", result, counters_since(stats, before)),
                                 pickle.HIGHEST_PROTOCOL))


# Counters the parent keeps itself (it times and counts the sentences of its own generate calls).
# Counted by the parent as the workers' results come back (the n-best lists it hands to fairseq included), or
# a setting rather than a counter (nbest): a worker's copy is not added to them.
_PARENT_COUNTERS = ("sentences", "wall_s", "window_start", "window_end", "short_nbest", "nbest")


class _Nested(dict):
    """The counters of a statistics object inside another (Jacobi's over its greedy decoder's)."""


def counters_of(stats) -> dict:
    """The numeric counters, histograms and step records of a decoder's statistics (empty for None)."""
    out = _Nested()
    for key, value in (vars(stats).items() if stats is not None else ()):
        if key in _PARENT_COUNTERS or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = value
        elif isinstance(value, list):
            out[key] = len(value)
        elif isinstance(value, dict):
            out[key] = dict(value)
        elif hasattr(value, "__dict__") and not callable(value):
            out[key] = counters_of(value)
    return out


def counters_since(stats, before: dict) -> dict:
    """What ``stats`` added since ``before`` (:func:`counters_of`): numbers and histograms as differences,
    lists as their new items, peaks as they are."""
    out = _Nested()
    for key, old in before.items():
        value = getattr(stats, key)
        if isinstance(old, _Nested):
            out[key] = counters_since(value, old)
        elif isinstance(value, list):
            out[key] = value[old:]
        elif isinstance(value, dict):
            out[key] = {k: v - old.get(k, 0) for k, v in value.items() if v != old.get(k, 0)}
        elif key.startswith("peak"):
            out[key] = value
        else:
            out[key] = value - old
    return out


def add_counters(stats, counters: Optional[dict]):
    """Add a worker's :func:`counters_since` to the parent's ``stats`` (peaks: the larger)."""
    for key, value in (counters or {}).items():
        old = getattr(stats, key, None)
        if isinstance(value, _Nested):
            add_counters(old, value)
        elif isinstance(old, list):
            old.extend(value)
        elif isinstance(old, dict):
            for k, v in value.items():
                old[k] = old.get(k, 0) + v
        elif key.startswith("peak"):
            setattr(stats, key, max(old, value))
        elif old is not None:
            setattr(stats, key, old + value)


# --- fairseq-generate and fairseq-interactive ---------------------------------------------


def on_workers(generator, layout, task, models, gen_cfg):
    """``generator`` on ``layout.workers`` worker processes (itself where the layout has one, or none).

    The hook where fairseq's ``task.build_generator`` hands out our
    generator: fairseq-generate's batches are read ahead from a copy of its
    epoch iterator (as the streaming look-ahead does), fairseq-interactive's
    are announced by its batching (:func:`announce`).
    """
    if layout is None or layout.workers <= 1:
        return generator
    from fairseq_stream.schedule.stream import fairseq_generate_batches

    root = _root_config(gen_cfg)
    batches = fairseq_generate_batches(task, models, root) if root is not None else None
    return WorkersGenerator(generator, layout.workers, models, batches, nbest=getattr(gen_cfg, "nbest", None))


def one_batch_at_a_time(gen_cfg) -> bool:
    """Whether the tool hands out one batch at a time, so that workers could not decode two at once:
    fairseq-interactive whose buffer (``--buffer-size`` lines; 1 by default) holds one ``--batch-size`` batch.

    There the default layout gives one decoder every core as kernel threads: with a worker a core, the
    buffer's one batch was decoded in the parent on one thread while the other cores idled (the stand-in,
    int8 fixed k=5, 8 lines: 6.0 s against 3.7 s on two threads; docs/threads.md). fairseq-interactive has
    set a buffer of at least 1 by the time it builds the generator; fairseq-generate's is 0.
    """
    root = _root_config(gen_cfg)
    buffer = getattr(getattr(root, "interactive", None), "buffer_size", None)
    if not buffer or buffer < 1:
        return False
    batch = getattr(getattr(root, "dataset", None), "batch_size", None)
    return batch is not None and buffer <= batch


def _root_config(gen_cfg):
    """The whole configuration the tool's generation section belongs to (None: not fairseq's DictConfig)."""
    from omegaconf import DictConfig

    return gen_cfg._get_root() if isinstance(gen_cfg, DictConfig) else None


# Generators that take fairseq-interactive's announced batches (weakly: one per built generator).
_listening: "weakref.WeakSet" = weakref.WeakSet()


def announce(samples: list):
    """fairseq-interactive's next batches (samples as it will pass them to ``generate``), before it asks."""
    for generator in list(_listening):
        generator.expect(samples)


class WorkersGenerator(DecoderWrapper):
    """A fairseq generator whose batches are decoded by :class:`Workers`, answered in fairseq's order.

    Args:
        decoder: what each worker decodes with (its copy, forked): the decoder, or a generator around it.
        n: workers.
        models: fairseq's models (``generate``'s argument).
        batches: a callable building fairseq-generate's epoch iterator again, or None.
        nbest: the hypotheses a sentence that fairseq-generate and fairseq-interactive print (``--nbest``):
            what the workers send back of each n-best list for the batches those tools announce or read
            ahead; None sends them whole. Batches decoded in this process keep their whole lists.
    """

    def __init__(self, decoder, n: int, models, batches: Optional[Callable] = None, nbest: Optional[int] = None):
        self.decoder, self.n, self.models = decoder, n, models
        self.nbest = int(nbest) if nbest is not None else None
        self._batches = batches
        self._workers = None
        self._ahead = None  # None: not decided; False: decode here; else the results of the look-ahead
        self._done = {}  # sentence id -> hypotheses, fairseq-generate's look-ahead
        self._expected = deque()  # fairseq-interactive: (sample, its results' iterator) announced
        self._sigint = None  # withdraws our stop from Ctrl-C's handler (interrupt.stop_first), while installed
        _listening.add(self)

    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        """Translate a fairseq sample; one list of hypotheses per sentence, in sample order."""
        from fairseq_stream.decoder import BeamDecoder

        BeamDecoder.check_call(prefix_tokens, constraints)
        start = time.perf_counter()
        try:
            results = self._from_workers(sample, bos_token)
        except KeyboardInterrupt:  # where our handler could not be set (not the main thread)
            self.close(wait=False)
            interrupt.interrupted()
        except BaseException:
            self.close(wait=False)
            raise
        if results is None:
            return self.decoder.generate(models, sample, bos_token=bos_token, **kwargs)
        self.stats.add_sentences(len(results), time.perf_counter() - start, results)
        return results

    def _from_workers(self, sample, bos_token) -> Optional[list]:
        if self._expected:
            return self._announced(sample)
        ids = sample.get("id")
        if self._ahead is None:
            self._ahead = ids is not None and self._start_ahead(sample, bos_token)
        if not self._ahead:
            return None
        return self._answer(ids.tolist())

    def _pool(self) -> Workers:
        if self._workers is None:
            # Only the pool's batches are trimmed to --nbest: they are the ones fairseq-generate reads ahead
            # and fairseq-interactive announces, and both print hypos[:nbest]. Any other caller (fairseq's
            # hub interface) is decoded in this process and gets its whole lists.
            self._workers = Workers(self.n, lambda task: decode_samples(self.decoder, self.models, *task,
                                                                        nbest=self.nbest), self.stats)
            self._stop_on_ctrl_c()
        return self._workers

    def _stop_on_ctrl_c(self):
        """Ctrl-C ends the workers with one line wherever it lands, not only inside ``generate``.

        Between two ``generate`` calls fairseq-generate prints hypotheses, and a
        KeyboardInterrupt there left fairseq's traceback and status -2. Only the
        main thread may set a handler; elsewhere ``generate``'s own catch stays.
        """
        self._sigint = interrupt.stop_first(lambda: self.close(wait=False), STOPPED)

    def _start_ahead(self, sample, bos_token) -> bool:
        itr = self._batches() if self._batches is not None else None
        first = next(iter(itr), None) if itr is not None else None
        if first is None or not torch.equal(first["id"].cpu(), sample["id"].cpu()):
            logger.info("fairseq-stream: the batches are not fairseq-generate's; decoding them in this process, "
                        "one at a time")
            return False

        def tasks():
            # One batch a task (the module's docstring says why), streamed by a pool of its own where the
            # generator streams.
            for batch in _chained(first, itr):
                if "net_input" in batch:
                    yield [batch], bos_token

        self._ahead = (pair for results in self._pool().map(tasks()) for pair in results)
        return self._ahead

    def _answer(self, wanted: list) -> list:
        while any(i not in self._done for i in wanted):
            pair = next(self._ahead, None)
            if pair is None:
                raise FairseqStreamError("the look-ahead never produced sentence(s) {}".format(
                    [i for i in wanted if i not in self._done][:5]))
            self._done[pair[0]] = pair[1]
        return [self._done.pop(i) for i in wanted]

    def expect(self, samples: list):
        """fairseq-interactive's coming ``samples``: handed to the workers now, answered as they are asked."""
        if len(samples) < 2:
            return  # one batch: nothing to decode at once
        tasks = (([_plain(s)], None) for s in samples)
        results = self._pool().map(tasks)
        for s in samples:
            self._expected.append((s["net_input"]["src_tokens"], results))

    def _announced(self, sample) -> Optional[list]:
        tokens, results = self._expected.popleft()
        answer = [hyps for _, hyps in next(results)]
        if not torch.equal(tokens, sample["net_input"]["src_tokens"]):
            self._expected.clear()
            raise FairseqStreamError("fairseq-interactive asked for other batches than it announced")
        return answer

    def close(self, wait: bool = True):
        """Stop the workers (fairseq never calls it; the end of the look-ahead, an error or exit does)."""
        if self._sigint is not None:
            withdraw, self._sigint = self._sigint, None
            withdraw()
        if self._workers is not None:
            self._workers.close(wait=wait)


def _chained(first, rest):
    yield first
    yield from rest


def _plain(sample) -> dict:
    """A sample as a worker gets it: the source tensors (no id: fairseq-interactive's have none)."""
    return {"net_input": {k: v for k, v in sample["net_input"].items()}}


def streams_across_batches(generator) -> bool:
    """Whether ``generator`` streams across fairseq-generate's batches (it reads ahead into later ones)."""
    return bool(getattr(generator, "reads_ahead", False))


def decode_samples(generator, models, samples: list, bos_token=None, nbest: Optional[int] = None) -> list:
    """In a worker: [(sentence id or row, hypotheses)] of ``samples``, as one process decodes them.

    A generator that streams across batches streams across these samples
    (one pool, as its look-ahead does); any other decodes each sample with
    one ``generate`` call. ``nbest``: each list's first ``nbest`` hypotheses
    only (what the parent prints; at k=5 and --nbest 1 the parent rebuilt
    five times the tensors it reads, on the cores the workers decode on);
    None: whole lists. Cut before the inference tensors are copied out, so
    the dropped hypotheses are never copied.
    """
    if streams_across_batches(generator) and all("id" in s for s in samples):
        cohorts = (generator.decoder.open(s["net_input"], ids=s["id"], bos_token=bos_token) for s in samples)
        with decoding():
            done = dict(generator.pool(samples[0]["id"].numel()).run(cohorts))
        return [(i, released(done[i][:nbest])) for s in samples for i in s["id"].tolist()]
    out = []
    for s in samples:
        hypotheses = generator.generate(models, s, bos_token=bos_token)
        ids = s["id"].tolist() if "id" in s else range(len(hypotheses))
        out.extend((i, nbest_list[:nbest]) for i, nbest_list in zip(ids, hypotheses))
    return out
