"""The encoder running ahead (Marian, Algorithm 4): an iterator produced in a background thread.

The streaming pool pulls encoded batches (``BeamDecoder.open`` runs the
encoder) only when it refills, so without help the decoder waits for the
encoder at every refill. :class:`ReadAhead` runs the producing iterator (read
a batch, encode it) in its own thread, up to ``size`` items ahead, into a
bounded queue the pool reads from.

Guarantees (tests/test_read_ahead.py):

* every item comes out once, in the producer's order; memory is bounded by
  ``size`` items in the queue plus the one being produced;
* the producer runs in the grad and inference modes of the thread that
  created it (both are per thread in torch: decoding's inference mode holds
  in the encoder too);
* an exception in the producer is raised in the consumer, with its original
  traceback, when the consumer reaches that point of the stream;
* the thread stops whenever the consumer stops: at the end, on an exception
  on either side, on KeyboardInterrupt, or when the consumer is closed or
  garbage-collected early (``close()``, a ``with`` block, a generator's
  ``finally``); :meth:`close` joins it, so no thread outlives the decoding;
* one still running when the interpreter exits (fairseq-generate never
  closes its look-ahead: an error or Ctrl-C outside the pool leaves it
  running) is stopped and joined at exit, before the interpreter finalizes
  (:mod:`fairseq_stream.exit_threads`: a thread left inside a torch
  operator then would abort the process).

Torch releases the GIL inside its operators, so on a machine with a spare
core the encoder's arithmetic overlaps the decoder's. On a GPU (``device``
a CUDA device) the producer runs on a CUDA stream of its own, so that the
encoder's kernels need not queue behind the decoder's (Marian's encoder
runs ahead the same way): each item is handed over with an event that the
consumer's stream waits on, and every CUDA tensor in it is recorded on the
consumer's stream, so that the caching allocator does not reuse its memory
for the producer while the consumer's kernels may still read it.
"""

import contextlib
import functools
import queue
import threading
import weakref
from typing import Iterable, Iterator, Optional

import torch

from fairseq_stream.exit_threads import join_at_exit
from fairseq_stream.ops import threads

_END = object()
# Seconds between checks of the stop flag while a side waits on the queue.
_POLL_S = 0.05


def tensors_in(obj, seen: Optional[set] = None):
    """Every tensor reachable from ``obj`` through containers and objects' attributes (modules excluded).

    A cohort holds its tensors in dataclasses, lists, dicts and the
    runners' state objects; each tensor comes once.
    """
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = obj
    elif hasattr(obj, "__dict__"):
        children = vars(obj).values()
    else:
        return
    for child in children:
        yield from tensors_in(child, seen)


class _StreamHandoff:
    """Items made on a CUDA stream of the producer's own, handed to the stream that was current at creation."""

    def __init__(self, device):
        self.consumer = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device=device)

    def producing(self):
        """The producer thread's context: its kernels go to the side stream.

        The side stream first waits for what the consumer has queued so far:
        the producer may read tensors made there (fairseq-generate's first
        batch is moved to the GPU before the look-ahead starts).
        """
        self.side.wait_stream(self.consumer)
        return torch.cuda.stream(self.side)

    def send(self, item):
        event = torch.cuda.Event()
        event.record(self.side)
        return item, event

    def receive(self, sent):
        item, event = sent
        self.consumer.wait_event(event)
        for t in tensors_in(item):
            if t.is_cuda:
                t.record_stream(self.consumer)
        return item


class ReadAhead(Iterator):
    """Iterate over ``items`` produced in a background thread, at most ``size`` ahead.

    Args:
        items: any iterable; it is iterated only in the background thread.
        size: queue length (>= 1).
        name: the thread's name (shows in tracebacks and debuggers).
        device: where the items' tensors live; on a CUDA device the producer
            runs on a CUDA stream of its own (see the module docstring).
    """

    def __init__(self, items: Iterable, size: int, name: str = "fairseq-stream-encoder", device=None):
        if size < 1:
            raise ValueError("size must be at least 1")
        on_cuda = device is not None and torch.device(device).type == "cuda"
        self._handoff = _StreamHandoff(torch.device(device)) if on_cuda else None
        self._queue: "queue.Queue" = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._source = items
        # Grad and inference modes are per thread: the producer runs in its creator's (decoding's
        # inference mode: tensors it makes are then inference tensors, as the consumer's are).
        self._grad = torch.is_grad_enabled()
        self._inference = torch.is_inference_mode_enabled()
        self._done = False
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        # Weakly: the registry's entry must not keep this object, and through it its key (the thread), alive.
        join_at_exit(self._thread, functools.partial(_close_if_alive, weakref.ref(self)))
        self._thread.start()

    def _produce(self):
        try:
            stream = self._handoff.producing() if self._handoff is not None else contextlib.nullcontext()
            with torch.inference_mode(self._inference), torch.set_grad_enabled(self._grad), stream:
                for item in self._source:
                    if not self._put((True, item if self._handoff is None else self._handoff.send(item))):
                        return
        except BaseException as e:  # noqa: B902  (handed to the consumer, traceback included)
            self._put((False, e))
            return
        finally:
            close = getattr(self._source, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    pass
        self._put((True, _END))

    def _put(self, entry) -> bool:
        """Queue ``entry`` unless the consumer has stopped; False if it has."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self):
        if self._done:
            raise StopIteration
        while True:
            try:
                ok, item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    # The producer died without a word (it cannot: _produce
                    # always queues an end or an error); do not wait forever.
                    self.close()
                    raise RuntimeError("the read-ahead thread stopped without ending its stream")
        if not ok:
            self.close()
            raise item
        if item is _END:
            self.close()
            raise StopIteration
        return item if self._handoff is None else self._handoff.receive(item)

    def close(self, timeout: Optional[float] = None):
        """Stop the producer and wait for its thread to end (idempotent)."""
        self._done = True
        self._stop.set()
        # Empty the queue so that a producer blocked on a full queue sees the stop flag.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the producer thread is still running."""
        return self._thread.is_alive()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # A consumer dropped mid-stream must not leave the thread producing.
        if not self._done:
            self._stop.set()


def _close_if_alive(ref):
    ahead = ref()
    if ahead is not None:
        ahead.close(timeout=0)


# The queue --encoder-queue's default takes where the thread is on.
AUTO_QUEUE = 2


def encoder_queue_for(option: Optional[int], device) -> int:
    """The encoder queue to use: ``option``, or the default measured for this machine (None).

    benchmarks/bench_topup.py, one CPU thread on a 2-core machine: the thread
    made top-up 1.06-1.19x faster (the encoder ran on the free core); with two
    threads (no free core) 0.92-0.96x. So by default it runs where the process
    leaves a core free: where neither torch's threads nor our kernels' (the
    CPU layout sets torch's to one and gives ours the cores: ops/threads.py)
    take every core it may run on (its affinity). Counting torch's alone, the
    thread ran beside two kernel threads on 2 cores (the WMT'19-sized
    stand-in, var-stream k=5 through the Python API, 5 interleaved pairs on
    the Zen 4 EPYC: 5.61-5.91 s with it, median 5.78, against 5.58-5.91,
    median 5.64, without). On a GPU it is off until measured there.
    """
    if option is not None:
        return option
    if torch.device(device).type != "cpu":
        return 0
    busy = max(torch.get_num_threads(), threads.kernel_threads())
    return AUTO_QUEUE if busy < threads.usable_cores() else 0


def read_ahead(items: Iterable, size: int, device=None) -> Iterator:
    """``items`` produced ``size`` ahead in a background thread (0: as they are, in this thread).

    A generator: closing it (or its being garbage-collected, or an exception
    in its consumer) stops and joins the thread. ``device``: as
    :class:`ReadAhead`'s (a CUDA device gives the producer its own stream).
    """
    if not size:
        yield from items
        return
    with ReadAhead(items, size, device=device) as ahead:
        yield from ahead
