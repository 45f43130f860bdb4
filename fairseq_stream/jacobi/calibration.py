"""Whether Jacobi's windows pay for this model on this CPU: measured call costs, observed acceptance.

A Jacobi window call verifies several tokens but costs more than greedy's
step: how much more depends on the CPU (an AVX-512 Xeon runs a call of up
to 4 positions in one pass over the weights, an AVX2-only EPYC does not)
and on the model; how many tokens it verifies depends on the text. On the
Multi30k transformer the default ran at 1.15x greedy on a Xeon and at 0.82x
on an EPYC. So the default (``--jacobi-calibrate auto``) decides at run time:

* :func:`measure` times, once per model shape and CPU, greedy's step and
  window calls of each width on synthetic sentences of forced length (the
  whole decoder path of each, fixed per-batch costs apart), for each batch
  size windows may run at; the table is cached (:func:`cache_file`);
* :class:`Chooser` then keeps, per batch size, a ledger of the batches
  decoded by windows: what their calls cost by the table and what greedy
  would have cost for the same outputs (greedy's outputs are the same
  tokens, so its step count is known exactly). Windows keep running while
  they cost less (by ``MARGIN``); otherwise the batch size runs greedy's
  own step, with a window batch now and then (``FIRST_PROBE`` batches, then
  twice as many each time, up to ``LAST_PROBE``) since the n-gram pool
  learns as the run goes. Every decision is on counts and the cached
  table, never on a clock during decoding: the same run decides the same.

Either way the tokens are greedy's: the choice changes speed only.
"""

import hashlib
import json
import logging
import math
import os
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from fairseq_stream import cpu_info

logger = logging.getLogger(__name__)

CALIBRATE = ("auto", "on", "off")
# Forced output lengths of the timed decodes: the per-call cost is the difference of the two, over
# the difference of their calls (the encoder and per-batch bookkeeping cancel out).
LENGTHS = (2, 26)
SOURCE_LENGTH = 12
# Interleaved rounds (after one warm-up). Each time is the fastest round's: other work on the machine
# only ever adds time (on a 2-core VM shared with two other jobs, medians of 5 were off by 2x).
ROUNDS = 5
MAX_ROWS = 4  # batch sizes calibrated at most (the CPU's default runs windows at 1 and 2 only)
# Windows must be predicted this much cheaper than greedy's step to run: the table's error.
MARGIN = 0.03
MIN_CALLS = 32  # window calls seen in a batch size before its first choice
HALF_LIFE_TOKENS = 2000  # the ledger forgets old batches as the n-gram pool learns
FIRST_PROBE, LAST_PROBE = 4, 64  # greedy batches between window batches, doubling
CACHE_VERSION = 1
# A call cost that drafts every guess (JacobiDecoder: no batch handed to greedy's step).
ALWAYS = 1e9


def cache_base(environ=os.environ) -> Path:
    """fairseq-stream's cache folder: the rule of ``scripts/toy_cache.py`` (which the package cannot import).

    ``$FAIRSEQ_STREAM_CACHE``, else ``$XDG_CACHE_HOME/fairseq-stream`` (an
    absolute XDG_CACHE_HOME only), else ``~/.cache/fairseq-stream``.
    """
    if environ.get("FAIRSEQ_STREAM_CACHE"):
        return Path(environ["FAIRSEQ_STREAM_CACHE"])
    xdg = environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "fairseq-stream"
    return Path.home() / ".cache" / "fairseq-stream"


def cache_file(signature: dict, environ=os.environ) -> Path:
    """Where the costs measured for ``signature`` (:func:`signature`) are cached."""
    digest = hashlib.sha1(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]
    return cache_base(environ) / "jacobi-calibration" / "{}.json".format(digest)


def signature(jacobi, device, rows: Sequence[int], widths: Sequence[int]) -> dict:
    """What the costs depend on: the models' shapes, the runner, the output layer, threads, CPU, the setting.

    Shapes, not weights: a call's cost is the same for any weights of one
    architecture, so a retrained model reuses its predecessor's table. The
    models are read through the Jacobi decoder's window runner.
    """
    runner = jacobi.windows.runner
    shapes = [[[name, list(p.shape), str(p.dtype)] for name, p in m.state_dict().items()] for m in runner.model.models]
    # Quantized products cost another share of a call (a float run's table keeps its key).
    quantize = getattr(runner, "quantize", None)
    return dict(version=CACHE_VERSION, torch=torch.__version__, hardware=_hardware(device), device=device.type,
                threads=torch.get_num_threads(), runner=type(runner).__name__,
                output=jacobi.output_backend, shapes=shapes, rows=list(rows), widths=list(widths), draft=jacobi.draft,
                **({"quantize": quantize} if quantize else {}))


@dataclass
class RowCosts:
    """Milliseconds at one batch size: a greedy step, a window call by positions, each path's per-batch cost."""

    greedy_step: float
    greedy_batch: float  # for the record: not used in the choice (Costs.greedy_batch)
    window_calls: List[Tuple[float, float]]  # (positions per call, ms per call), positions ascending
    window_batch: float

    def window_call(self, positions: float) -> float:
        """A window call of ``positions`` (all rows together): linear between the measured ones, and beyond them."""
        points = self.window_calls
        if len(points) == 1 or positions <= points[0][0]:
            return points[0][1]
        for (p0, t0), (p1, t1) in zip(points, points[1:]):
            if positions <= p1:
                return t0 + (t1 - t0) * (positions - p0) / (p1 - p0) if p1 > p0 else t1
        (p0, t0), (p1, t1) = points[-2], points[-1]
        slope = max(0.0, (t1 - t0) / (p1 - p0)) if p1 > p0 else 0.0
        return t1 + slope * (positions - p1)


@dataclass
class Costs:
    """The calibration: :class:`RowCosts` by batch size, and where they came from."""

    rows: Dict[int, RowCosts]
    hardware: str = ""
    source: str = "given"  # "measured", "cache" or "given" (tests, benchmarks)
    path: Optional[str] = None
    seconds: float = 0.0  # what measuring took

    def greedy_batch(self, rows: int, lengths: Sequence[int]) -> float:
        """Greedy's predicted ms of steps for a batch of ``rows`` whose outputs have ``lengths`` tokens (EOS included).

        Steps only, as :meth:`window_batch` counts calls only: both paths
        encode once per batch, and the rest of their fixed costs (in the
        table) are too small to tell apart on a loaded machine.

        ``lengths`` has one entry per sentence with a non-empty source (an
        empty one takes no step).
        """
        total, alive = 0.0, len(lengths)
        previous = 0
        for length in sorted(lengths):
            # Steps previous+1 .. length run with ``alive`` sentences.
            if length > previous and alive:
                total += (length - previous) * self.rows[alive].greedy_step
            previous = max(previous, length)
            alive -= 1
        return total

    def window_batch(self, rows: int, calls: Sequence[Tuple[int, int]]) -> float:
        """The windows' predicted ms of calls for a batch that made ``calls`` ((rows, positions) each)."""
        return sum(self.rows[r].window_call(p) for r, p in calls)

    def can_pay(self, rows: int, widths: Sequence[int]) -> bool:
        """Whether some window of ``widths`` costs less than greedy's steps for its tokens, all of them accepted."""
        r = self.rows[rows]
        return any(r.window_call(rows * w) < w * r.greedy_step for w in widths if w > 1)

    def to_json(self) -> dict:
        return dict(hardware=self.hardware, seconds=self.seconds,
                    rows={str(k): asdict(v) for k, v in self.rows.items()})

    @staticmethod
    def from_json(data, source: str, path: Optional[str]) -> "Costs":
        """The table :meth:`to_json` wrote, checked whole (a cache is anyone's file).

        Raises:
            ValueError: a wrong shape or value (a string, zero or no
                positions where a cost must be); the message says which.
        """
        if not isinstance(data, dict) or not isinstance(data.get("rows"), dict) or not data["rows"]:
            raise ValueError("its costs are not a table with rows")
        rows = {_batch_size(k): _row_costs(k, v) for k, v in data["rows"].items()}
        hardware = data.get("hardware", "")
        if not isinstance(hardware, str):
            raise ValueError("its hardware is {!r}, not a string".format(hardware))
        return Costs(rows, hardware, source, path, _number(data.get("seconds", 0.0), "its seconds"))

    def describe(self) -> str:
        """The table in one line: per batch size, a greedy step and a window call by positions in greedy steps."""
        parts = []
        for n in sorted(self.rows):
            r = self.rows[n]
            calls = ", ".join("{:g}: {:.2f}".format(p, t / r.greedy_step) for p, t in r.window_calls)
            parts.append("{} sentence{}: a greedy step {:.3f} ms, a window call of positions {} greedy steps".format(
                n, "" if n == 1 else "s", r.greedy_step, calls))
        return "; ".join(parts)


def load_or_measure(jacobi, device, rows: Sequence[int], widths: Sequence[int]) -> Costs:
    """The cached table for this model, CPU and setting, else :func:`measure` it and cache it (best effort).

    The cache is a hint: a file that cannot be read or holds anything but
    such a table (another shape, a cost of zero, a directory or a FIFO in its
    place) is one warning line and a new measurement, never an error.
    """
    sig = signature(jacobi, device, rows, widths)
    path = cache_file(sig)
    costs, unusable = _read_cache(path, sig, rows)
    if costs is not None:
        return costs
    costs = measure(jacobi, device, rows, widths)
    unwritten = _write_cache(path, sig, costs)
    costs.path = None if unwritten else str(path)
    if unusable and unwritten:
        logger.warning("jacobi: ignoring the calibration cache %s (%s); measured again, and could not cache it "
                       "(%s): it is measured again next run", path, unusable, unwritten)
    elif unusable:
        logger.warning("jacobi: ignoring the calibration cache %s (%s); measured again and cached", path, unusable)
    elif unwritten:
        logger.warning("jacobi: could not cache the calibration in %s (%s); it is measured again next run",
                       path, unwritten)
    return costs


def log_costs(costs: Costs):
    """One log line: the table, and whether it was measured now (and where it is cached) or read."""
    cached = "cached in {}".format(costs.path) if costs.path else "not cached"
    where = ("measured in {:.1f} s, {}".format(costs.seconds, cached)
             if costs.source == "measured" else "read from {}".format(costs.path))
    logger.info("jacobi: the cost of windows on %s (%s): %s", costs.hardware, where, costs.describe())


def _read_cache(path: Path, sig: dict, rows: Sequence[int]) -> Tuple[Optional[Costs], Optional[str]]:
    """(the cached costs, None), or (None, why they cannot be used); (None, None) where there is no cache yet."""
    try:
        data = json.loads(_read_regular_file(path).decode("utf-8"))
    except FileNotFoundError:
        return None, None
    except _NotRegularFile as e:
        return None, str(e)
    except OSError as e:
        return None, "{}: {}".format(type(e).__name__, e)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past the parser's depth
        return None, "it is not JSON: {}".format(e)
    if not isinstance(data, dict) or "signature" not in data:
        return None, "it is not a calibration (a JSON object with a signature and costs)"
    if data["signature"] != sig:
        return None, "it was written for another model, device or setting"
    try:
        costs = Costs.from_json(data.get("costs"), "cache", str(path))
    except ValueError as e:
        return None, str(e)
    if sorted(costs.rows) != sorted(rows):
        return None, "its batch sizes are {}, not {}".format(sorted(costs.rows), sorted(rows))
    return costs, None


class _NotRegularFile(ValueError):
    pass


def _read_regular_file(path: Path) -> bytes:
    """The bytes of ``path`` if it is a regular file; :class:`_NotRegularFile` for anything else.

    Opened without blocking and checked on the open file: a FIFO in the
    cache's place would otherwise hang the run in ``open()`` for a writer
    that never comes, and a check before opening could be raced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                     (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
            kind = next((name for test, name in kinds if test(mode)), "special file")
            raise _NotRegularFile("it is a {}, not a regular file".format(kind))
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _write_cache(path: Path, sig: dict, costs: Costs) -> Optional[str]:
    """Cache ``costs`` at ``path``; None, or why it could not (no temporary file is left behind)."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole then renamed: a reader beside us sees the old file or the new one.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            temporary = f.name
            json.dump(dict(signature=sig, costs=costs.to_json()), f)
        os.replace(temporary, path)  # a directory in the cache's place refuses it
        return None
    except OSError as e:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass  # the folder went too: nothing is left to remove
        return "{}: {}".format(type(e).__name__, e)


def _number(value, what: str, positive: bool = False) -> float:
    """``value`` as a float if it is a finite number >= 0 (> 0 where ``positive``), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise ValueError("{} is {!r}, not a finite number {} 0".format(what, value, ">" if positive else ">="))
    return float(value)


def _batch_size(key) -> int:
    """A row's key: a batch size of at least 1, as :meth:`Costs.to_json` writes it ("2")."""
    if not isinstance(key, str) or not key.isdecimal() or int(key) < 1:
        raise ValueError("its row {!r} is not a batch size".format(key))
    return int(key)


def _row_costs(key: str, row) -> RowCosts:
    """One row of the cached table, checked: a greedy step costs more than 0 (costs are divided by it), and window
    calls are (positions, ms) pairs by ascending positions, at least one (they are interpolated)."""
    if not isinstance(row, dict):
        raise ValueError("its row {} is {!r}, not a mapping".format(key, row))
    calls = row.get("window_calls")
    if not isinstance(calls, list) or not calls:
        raise ValueError("its row {}'s window_calls is {!r}, not a list of (positions, ms)".format(key, calls))
    points = []
    for point in calls:
        if not isinstance(point, list) or len(point) != 2:
            raise ValueError("its row {}'s window call {!r} is not (positions, ms)".format(key, point))
        points.append(tuple(_number(v, "its row {}'s window call {!r}".format(key, point)) for v in point))
    if points != sorted(points, key=lambda p: p[0]):
        raise ValueError("its row {}'s window calls are not by ascending positions".format(key))
    what = "its row {}'s {}".format
    return RowCosts(_number(row.get("greedy_step"), what(key, "greedy_step"), positive=True),
                    _number(row.get("greedy_batch"), what(key, "greedy_batch")), points,
                    _number(row.get("window_batch"), what(key, "window_batch")))


def measure(jacobi, device, rows: Sequence[int], widths: Sequence[int]) -> Costs:
    """Time greedy's step and window calls of ``widths`` at each of ``rows`` sentences a batch.

    Synthetic sentences (seeded random source tokens) decode to a forced
    length (``--min-len`` = maximum length), each configuration at the two
    ``LENGTHS``, in interleaved rounds; the difference of the fastest
    rounds over the difference of the calls is a call's cost, the rest a
    batch's fixed cost. Windows run the decoder's own loop and drafts, so
    their bookkeeping is in the price: n-gram drafts from a pool that holds
    the sentences' own outputs, every token drafted (each call has the
    width asked for, as in a run whose pool has learnt).
    """
    start = time.perf_counter()
    greedy = jacobi.greedy
    samples = {r: _synthetic_sample(jacobi, r, device, seed=r) for r in rows}
    configs = [(r, None) for r in rows] + [(r, w) for r in rows for w in widths]
    times: Dict[tuple, List[float]] = {}
    calls: Dict[tuple, Tuple[int, int]] = {}
    for round_ in range(ROUNDS + 1):  # round 0 warms up
        for r, w in configs:
            for length in LENGTHS:
                probe = _forced_length(greedy, length)
                if w is None:
                    dec = probe
                else:
                    dec = _window_probe(type(jacobi), probe, w, jacobi.draft, samples[r], length)
                _sync(device)
                t0 = time.perf_counter()
                with torch.no_grad():
                    dec.generate(None, samples[r])
                _sync(device)
                seconds = time.perf_counter() - t0
                if round_:
                    times.setdefault((r, w, length), []).append(seconds)
                calls[(r, w, length)] = (dec.stats.timesteps, dec.stats.expansions)
    table = {}
    for r in rows:
        greedy_step, greedy_batch = _fit(times, calls, (r, None))
        points, batch_costs = [], []
        for w in widths:
            per_call, per_batch = _fit(times, calls, (r, w))
            (c1, p1), (c2, p2) = calls[(r, w, LENGTHS[0])], calls[(r, w, LENGTHS[1])]
            points.append(((p2 - p1) / max(1, c2 - c1), per_call))
            batch_costs.append(per_batch)
        points.sort()
        # A wider call never costs less: what says so is noise.
        for i in range(1, len(points)):
            points[i] = (points[i][0], max(points[i][1], points[i - 1][1]))
        table[r] = RowCosts(greedy_step, greedy_batch, points, sorted(batch_costs)[len(batch_costs) // 2])
    return Costs(table, _hardware(device), "measured", None, time.perf_counter() - start)


def _hardware(device) -> str:
    """The GPU's name, or the CPU's model and SIMD level: what a table of costs holds for."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_info.describe()


def _window_probe(JacobiDecoder, probe, width: int, draft: str, sample: dict, length: int):
    """A Jacobi decoder (of the calibrated one's class: no import back) over ``probe`` whose every call is
    ``width`` positions a sentence (to the end)."""
    if draft != "ngram":
        return JacobiDecoder(probe, "hgj", width, "pad")  # PAD drafts: every row its whole window
    outputs = _forced_length(probe, length).generate(None, sample)
    dec = JacobiDecoder(probe, "hgj", width, "ngram", call_cost=ALWAYS)
    for hypos in outputs:
        dec.pool.add_output([probe.eos] + hypos[0]["tokens"].tolist())
    return dec


def _fit(times, calls, config) -> Tuple[float, float]:
    """(ms per call, ms per batch) of ``config`` from its fastest rounds at the two lengths."""
    t1, t2 = (min(times[config + (n,)]) * 1000 for n in LENGTHS)
    c1, c2 = (calls[config + (n,)][0] for n in LENGTHS)
    per_call = max((t2 - t1) / max(1, c2 - c1), 1e-6)
    return per_call, max(0.0, t1 - c1 * per_call)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _synthetic_sample(jacobi, rows: int, device, seed: int) -> dict:
    """A fairseq batch of ``rows`` random sources of ``SOURCE_LENGTH`` tokens (EOS last)."""
    vocab = jacobi.windows.runner.model.models[0].encoder.embed_tokens.num_embeddings
    gen = torch.Generator().manual_seed(seed)
    # fairseq dictionaries: 0-3 are BOS, PAD, EOS, UNK.
    tokens = torch.randint(4, max(5, vocab), (rows, SOURCE_LENGTH - 1), generator=gen)
    tokens = torch.cat([tokens, torch.full((rows, 1), jacobi.eos, dtype=torch.long)], dim=1).to(device)
    lengths = torch.full((rows,), SOURCE_LENGTH, dtype=torch.long, device=device)
    return {"id": torch.arange(rows), "net_input": {"src_tokens": tokens, "src_lengths": lengths}}


def _forced_length(greedy, length: int):
    """A copy of ``greedy`` (sharing its runner and weights) whose every output has ``length`` tokens before EOS."""
    return greedy.with_lengths(0, length, length)


@dataclass
class _Ledger:
    """One batch size's record: predicted ms of its window batches and of greedy for the same outputs."""

    window_ms: float = 0.0
    greedy_ms: float = 0.0
    calls: float = 0.0  # window calls (decayed as the sums are)
    greedy_calls: float = 0.0  # greedy's calls for the same batches
    seen_calls: int = 0  # window calls ever seen (not decayed): the first choice waits for MIN_CALLS
    choice: Optional[str] = None  # "windows", "greedy" once chosen
    interval: int = FIRST_PROBE
    wait: int = 0  # greedy batches before the next window batch
    switches: int = 0
    logged: bool = False


@dataclass
class Chooser:
    """Per batch size: windows or greedy's step, from the :class:`Costs` table and the windows' record so far.

    Args:
        costs: the calibration.
        widths: the window widths the setting runs (a window of w positions
            a row accepts at most w tokens: where none is cheaper than w
            greedy steps, windows never pay and are never run).
    """

    costs: Costs
    widths: Sequence[int]
    ledgers: Dict[int, _Ledger] = field(default_factory=dict)

    def windows(self, rows: int) -> bool:
        """Whether the next batch of ``rows`` sentences runs windows (True) or greedy's step."""
        if rows not in self.costs.rows:
            return True  # not calibrated (a batch size above MAX_ROWS): the setting as asked
        ledger = self.ledgers.setdefault(rows, _Ledger())
        if not self.costs.can_pay(rows, self.widths):
            self._choose(rows, ledger, "greedy", "no window of {} positions a sentence costs less than greedy's steps "
                         "for as many tokens".format("/".join(map(str, self.widths))))
            return False
        if ledger.seen_calls < MIN_CALLS:
            return True
        if ledger.window_ms <= (1.0 - MARGIN) * ledger.greedy_ms:
            ledger.interval = FIRST_PROBE
            self._choose(rows, ledger, "windows", self._why(rows, ledger))
            return True
        if ledger.choice != "greedy":
            ledger.wait = ledger.interval
            self._choose(rows, ledger, "greedy", self._why(rows, ledger))
        if ledger.wait <= 0:
            # A window batch: the pool has learnt since, and the ledger needs its acceptance.
            ledger.interval = min(2 * ledger.interval, LAST_PROBE)
            ledger.wait = ledger.interval
            return True
        ledger.wait -= 1
        return False

    def saw_windows(self, rows: int, lengths: Sequence[int], calls: Sequence[Tuple[int, int]]):
        """A batch of ``rows`` decoded by windows: its outputs' lengths (EOS included) and its calls' shapes."""
        if rows not in self.costs.rows or not lengths:
            return
        ledger = self.ledgers.setdefault(rows, _Ledger())
        self._forget(ledger, lengths)
        ledger.window_ms += self.costs.window_batch(rows, calls)
        ledger.greedy_ms += self.costs.greedy_batch(rows, lengths)
        ledger.calls += len(calls)
        ledger.greedy_calls += max(lengths)
        ledger.seen_calls += len(calls)

    def saw_greedy(self, rows: int, lengths: Sequence[int]):
        """A batch of ``rows`` decoded by greedy's step (its outputs' lengths): the ledger ages."""
        if rows in self.ledgers:
            self._forget(self.ledgers[rows], lengths)

    @staticmethod
    def _forget(ledger: _Ledger, lengths: Sequence[int]):
        keep = 0.5 ** (sum(lengths) / HALF_LIFE_TOKENS)
        ledger.window_ms *= keep
        ledger.greedy_ms *= keep
        ledger.calls *= keep
        ledger.greedy_calls *= keep

    def _why(self, rows: int, ledger: _Ledger) -> str:
        step = self.costs.rows[rows].greedy_step
        return "a window call costs {:.2f} greedy steps and replaces {:.2f}".format(
            ledger.window_ms / max(ledger.calls, 1e-9) / step, ledger.greedy_calls / max(ledger.calls, 1e-9))

    def _choose(self, rows: int, ledger: _Ledger, choice: str, why: str):
        if ledger.choice == choice:
            return
        if ledger.choice is not None:
            ledger.switches += 1
        ledger.choice = choice
        where = "cached in {}".format(self.costs.path) if self.costs.path else "not cached"
        line = "jacobi: batches of %d sentence%s: %s: running %s (calibrated on %s, %s)"
        args = (rows, "" if rows == 1 else "s", why, "windows" if choice == "windows" else "greedy's step",
                self.costs.hardware or "this device", where)
        # The first choice at INFO; later changes (the pool learns) at DEBUG, counted in the stats.
        (logger.info if not ledger.logged else logger.debug)(line, *args)
        ledger.logged = True
