"""Count host synchronizations on the CPU, where there is no device to wait for.

A *host synchronization* is any operation that makes a tensor's value (or a
shape that depends on its values) visible to Python. On a GPU each one stalls
the host until the device has caught up, so a search step that does several
of them cannot run ahead of the device. On the CPU nothing stalls, so these
counts come from watching the torch calls (a ``TorchFunctionMode``: nothing
in torch is patched, nothing is left to restore) for the operations that
would:

* reading values: ``Tensor.item``, ``tolist``, ``numpy``, ``__array__``,
  ``cpu``, ``to("cpu")``, ``int(t)``, ``float(t)``, ``bool(t)`` (also
  ``if t.any():``), ``operator.index(t)`` (a tensor used as a Python index),
  ``x in t``, ``torch.equal``, ``torch.allclose``, ``torch.is_nonzero``,
  ``torch.tensor(...)`` of a list holding tensors;
* host-to-device copies of Python data: ``torch.tensor(data, device=...)``
  and ``torch.as_tensor(data, device=...)`` (with any ``device``: the same
  call puts it on the models' GPU in a GPU run; CUDA copies pageable memory
  and waits for it), where ``data`` is not a tensor;
* data-dependent shapes: ``nonzero`` (``torch.nonzero``, ``Tensor.nonzero``,
  ``torch.argwhere``, one-argument ``torch.where``), boolean-mask indexing
  (``t[mask]``, ``t[mask] = v``, ``index_put_`` with a mask),
  ``masked_select``, ``unique``/``unique_consecutive``, ``bincount`` (its
  CUDA kernel reads the input's range even with ``minlength``), and
  ``repeat_interleave`` with tensor repeats and no ``output_size``.

Not counted: copies with ``non_blocking=True`` (``to``, ``copy_``: a copy to
or from pinned memory does not wait; the later read of the pinned buffer on
the host, e.g. its ``tolist``, is the sync, and is counted).

Every tensor is a CPU tensor here, so a read of a tensor that would live on
the host anyway in a GPU run counts too; and operations inside C++ (a kernel
that synchronizes internally) are not seen. The counts are an upper bound on
the Python-visible reads, deterministic, and cheap to assert on in tests. On
a GPU the real check is ``torch.cuda.set_sync_debug_mode("warn")`` (or
``"error"``), which flags every synchronizing CUDA call.

    with HostSyncCounter() as counter:
        ...
    counter.count, counter.events

:func:`count_update_syncs` counts each cohort's search step of a decoder
separately (the output layer of the engine's model call, the policy's
``select`` and the bookkeeping's ``update``), and the calls to its model
runner apart.
:class:`OpTrace` records the ATen calls below (what a CUDA graph capture
records) and flags those that read a value or shape their output by values.
"""

import contextlib
from dataclasses import dataclass, field
from typing import List

import torch
from torch.overrides import TorchFunctionMode

# Torch functions and Tensor methods (by name) that always read the device.
ALWAYS = frozenset((
    "item", "tolist", "numpy", "__array__", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "__contains__", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
    "equal", "allclose", "is_nonzero",
))


def _has_mask(index) -> bool:
    """Whether an indexing key holds a boolean tensor (a data-dependent shape)."""
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, (tuple, list)):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    try:
        return target is not None and torch.device(target).type == "cpu"
    except (TypeError, RuntimeError):
        return False  # a dtype: no device change


def is_sync(name: str, args, kwargs) -> bool:
    """Whether the torch call ``name(*args, **kwargs)`` synchronizes the host with the device."""
    if name in ALWAYS:
        return True
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        return len(args) > 1 and _has_mask(args[1])
    if name == "repeat_interleave":
        # Tensor repeats: the output size is their sum, unless given.
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        return kwargs.get("output_size") is None and isinstance(repeats, torch.Tensor)
    if name == "where":
        return len(args) + len(kwargs) == 1  # torch.where(cond) is nonzero
    if name in ("tensor", "as_tensor"):
        data = args[0] if args else kwargs.get("data")
        if isinstance(data, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in data):
            return True
        # Python data copied to a device.
        return not isinstance(data, torch.Tensor) and kwargs.get("device") is not None
    if name == "to":
        return not kwargs.get("non_blocking", False) and _to_cpu(args, kwargs)
    return False


class _Mode(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if counter.enabled:
            name = getattr(func, "__name__", "")
            if is_sync(name, args, kwargs):
                counter.record(name)
        # Calls made by func itself do not come back here (the mode is off
        # inside its own handler): a sync counts once.
        return func(*args, **kwargs)


class HostSyncCounter:
    """Counts host synchronizations while active (see the module docstring for what counts).

    A context manager (re-entrant): it sees every torch call made inside it
    through a :class:`~torch.overrides.TorchFunctionMode`, and patches
    nothing. ``count`` is the total, ``events`` the (operation, ``file:line``
    of the caller) of each one.

    Args:
        enabled: count from the start (else only inside :meth:`counting`).
    """

    def __init__(self, enabled: bool = True):
        self.count = 0
        self.events = []
        self.enabled = enabled
        self._modes = []

    def record(self, name: str):
        """Count one sync of operation ``name``."""
        self.count += 1
        self.events.append((name, _caller()))

    def __enter__(self):
        mode = _Mode(self)
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc):
        self._modes.pop().__exit__(*exc)
        return False

    def paused(self):
        """Do not count inside this block (e.g. calls into code that is not under test)."""
        return self._enabled(False)

    def counting(self):
        """Count inside this block (for a counter made with ``enabled=False``)."""
        return self._enabled(True)

    @contextlib.contextmanager
    def _enabled(self, value: bool):
        enabled, self.enabled = self.enabled, value
        try:
            yield self
        finally:
            self.enabled = enabled


# ATen operations that read a value back to the host or whose output's shape depends on values: what a CUDA
# graph cannot capture (``repeat_interleave`` and ``index``/``index_put_`` only with tensor repeats or a
# boolean index, see _data_dependent).
DATA_DEPENDENT_OPS = frozenset((
    "nonzero", "argwhere", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
    "bincount", "equal", "_local_scalar_dense", "is_nonzero", "allclose", "masked_scatter",
))


@dataclass(frozen=True)
class AtenCall:
    """One ATen call: the overload's name, its tensor arguments' shapes and types, and whether it reads the
    device or shapes its output by values (:data:`DATA_DEPENDENT_OPS`)."""

    op: str
    shapes: tuple
    dtypes: tuple
    data_dependent: bool


def _tensors_of(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors_of(a)


def _data_dependent(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in DATA_DEPENDENT_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return any(t.dtype == torch.bool for t in _tensors_of(args[1:2]))
    # repeat_interleave.Tensor(repeats) and .self_Tensor without output_size: the output's length is a sum.
    return name == "repeat_interleave" and func._overloadname != "self_int" and kwargs.get("output_size") is None


class OpTrace:
    """The ATen calls made inside it (a ``TorchDispatchMode``, below autograd: the operations a CUDA graph
    capture records), for checks of a step's calls on the CPU.

    ``calls`` lists :class:`AtenCall`; a tensor's ``tolist`` reads memory without an ATen call, so host
    reads are :class:`HostSyncCounter`'s to count.
    """

    def __init__(self):
        self.calls: List[AtenCall] = []
        self._mode = None

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        trace = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                tensors = list(_tensors_of(args))
                trace.calls.append(AtenCall(str(func), tuple(tuple(t.shape) for t in tensors),
                                            tuple(str(t.dtype) for t in tensors),
                                            _data_dependent(func, args, kwargs or {})))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False

    def data_dependent(self) -> List[AtenCall]:
        """The calls that read the device or shape their output by values."""
        return [c for c in self.calls if c.data_dependent]


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and "/torch/" not in path:
            return "{}:{}".format(path, frame.f_lineno)
        frame = frame.f_back
    return "?"


@dataclass
class UpdateSyncs:
    """Host synchronizations of one cohort's search step (up to its bookkeeping's ``update`` call), and of the
    runner calls before and in it."""

    step: int  # the cohort's step when it was called
    syncs: int  # the step's own: the output layer's, select's and update's (their calls to the runner not included)
    finished: int  # sentences that finished in it
    events: list
    # The runner's calls since the previous update, this one's reorder included: their names, syncs and events.
    runner_calls: list = field(default_factory=list)
    runner_syncs: int = 0
    runner_events: list = field(default_factory=list)

    @property
    def quiet(self) -> bool:
        """No sentence finished in it and none entered: not a cohort's first step, and the runner only stepped
        and reordered since the previous update (no group started, split or joined)."""
        return not self.finished and self.step > 0 and set(self.runner_calls) <= set(STEP_METHODS)


# The runner's methods of a step (the decoder call and the search's reorder); the others start, split and
# join groups of sentences (the scheduler's work when sentences enter).
STEP_METHODS = ("step", "step_mixed", "step_own", "reorder")
RUNNER_METHODS = STEP_METHODS + ("start", "take", "concat")


@contextlib.contextmanager
def count_update_syncs(decoder):
    """Count the host synchronizations of each cohort's search step made inside the block.

    Yields a list that receives one :class:`UpdateSyncs` per bookkeeping's update: the syncs since the previous
    one in what the engine calls (``decoder.call_model``: the output layer; ``decoder.policy.select``;
    ``decoder.books.update``). The calls to ``decoder.runner`` are counted apart: each record holds those since
    the previous record (the decoder call, its reorder, and any start, split or join of groups between them).
    """
    records: List[UpdateSyncs] = []
    counter, runner_counter = HostSyncCounter(), HostSyncCounter()
    calls: List[str] = []
    inside: List[bool] = []  # a runner method calling another one (fairseq's take reorders) counts once
    recorded = [0]  # the counter's events already in a record
    update, runner = decoder.books.update, decoder.runner

    def counted(method):
        def call(*args, **kwargs):
            with counter:
                return method(*args, **kwargs)
        return call

    def counted_update(c, chosen):
        step = c.step
        with counter:
            finished = update(c, chosen)
        events, runner_events = counter.events[recorded[0]:], list(runner_counter.events)
        recorded[0] = len(counter.events)
        records.append(UpdateSyncs(step, len(events), len(finished), events, list(calls), len(runner_events),
                                   runner_events))
        calls.clear()
        runner_counter.events.clear()
        return finished

    def counted_apart(name, method):
        def call(*args, **kwargs):
            if inside:
                return method(*args, **kwargs)
            calls.append(name)
            inside.append(True)
            try:
                with counter.paused(), runner_counter:
                    return method(*args, **kwargs)
            finally:
                inside.pop()

        return call

    wrapped = [name for name in RUNNER_METHODS if callable(getattr(runner, name, None))]
    phases = [(decoder, "call_model", counted(decoder.call_model)),
              (decoder.policy, "select", counted(decoder.policy.select)), (decoder.books, "update", counted_update)]
    for owner, name, method in phases + [(runner, name, counted_apart(name, getattr(runner, name)))
                                         for name in wrapped]:
        setattr(owner, name, method)
    try:
        yield records
    finally:
        for owner, name, _ in phases:
            delattr(owner, name)
        for name in wrapped:
            delattr(runner, name)
