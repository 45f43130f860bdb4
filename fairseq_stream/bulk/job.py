"""One rank of a bulk translation job, on torch.distributed (launched by torchrun, or alone).

Every rank loads the model once, then takes chunks from a shared counter in
the torch.distributed store (an atomic ``add``: a rank that finishes takes
the next free chunk, so fast ranks take more), skips chunks already done by
an earlier run (:func:`~fairseq_stream.bulk.chunks.chunk_done`), translates
the others with :class:`~fairseq_stream.api.Translator` (any of our searches,
streaming within the rank) and writes them atomically. Rank 0 shows one
progress bar for the whole job (sentences done by all ranks, from a second
counter in the store), waits until every rank has written its last chunk
(a barrier in the store: the job makes no process group), and merges the
chunks into the output in input order.

Without torchrun's environment (``WORLD_SIZE`` unset) the job runs as one
rank with an in-process store.
"""

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from fairseq_stream.bulk import chunks as ch
from fairseq_stream.errors import FairseqStreamError

logger = logging.getLogger(__name__)

# The store's keys; a PrefixStore keeps them apart from torchrun's own.
NEXT_CHUNK, SENTENCES_DONE, INDEX = "next_chunk", "sentences_done", "input_index"
RANKS_DONE, ALL_DONE = "ranks_done", "all_done"
PROGRESS_EVERY = 64  # sentences between a rank's progress reports to the store
# Rank 0 waits this long at the end for the slowest rank's last chunk (a
# launcher that dies meanwhile takes the ranks with it: see launcher.py).
STORE_TIMEOUT = timedelta(hours=24)
# Start-up waits (the store, rank 0's input index) give up far sooner: a rank
# that outlived its launcher must not wait a day for a store that is gone.
STARTUP_TIMEOUT = timedelta(minutes=10)
LONG_LINES = ("error", "skip", "truncate")


@dataclass
class JobSettings:
    """What decides a chunk's output (hashed into every manifest), and how to translate."""

    paths: List[str]
    search: str = "var-stream"
    beam: int = 5
    data: Optional[str] = None
    bpe: Optional[str] = None
    tokenizer: Optional[str] = None
    sentencepiece_model: Optional[str] = None
    bpe_codes: Optional[str] = None
    options: Dict[str, object] = field(default_factory=dict)

    def digest(self) -> str:
        """SHA-256 of these settings and of the checkpoints' identity (path, size, modification time)."""
        files = []
        for p in self.paths:
            try:
                st = os.stat(p)
                files.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
            except OSError:
                files.append([os.path.abspath(p), None, None])
        values = dict(self.__dict__, paths=files)
        for name in ("data", "sentencepiece_model", "bpe_codes"):  # the same files, however they are named
            if values[name]:
                values[name] = os.path.abspath(values[name])
        return ch.settings_digest(values)

    def translator(self, **how):
        """The :class:`~fairseq_stream.api.Translator` of these settings; ``how``: the Translator's other
        arguments (pool, batch size, device, ...), which decide how fast, not what."""
        from fairseq_stream.api import Translator

        return Translator(self.paths, data=self.data, search=self.search, beam=self.beam, bpe=self.bpe,
                          tokenizer=self.tokenizer, sentencepiece_model=self.sentencepiece_model,
                          bpe_codes=self.bpe_codes, **how, **self.options)


class Ranks:
    """This process's place in the job: rank, world size, the shared store, the device.

    The job needs nothing from torch.distributed but its store (the chunk
    counter, the progress counter, the input index and the end-of-job
    barrier): no process group is made, so a GPU rank holds no NCCL buffers.
    Waits at start-up (the store's address, rank 0's input index) give up
    after ``startup_timeout``; only the end-of-job barrier, where rank 0 waits
    for the slowest rank's last chunk, waits longer (:data:`STORE_TIMEOUT`).
    """

    def __init__(self, use_cuda: bool, startup_timeout: timedelta = STARTUP_TIMEOUT):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.startup_timeout = startup_timeout
        if use_cuda:
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        if self.world == 1:
            self.base = dist.HashStore()
            self.store = self.base
            self._address = None
            return
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT; without
        # an agent (a plain multi-process launch) rank 0 hosts it.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self._address = (host, port)
        try:
            self.base = dist.TCPStore(host, port, self.world, is_master=(self.rank == 0 and not agent),
                                      timeout=startup_timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
            raise FairseqStreamError("rank {} could not reach the job's store at {}:{} within {:.0f} s ({}); "
                                     "is the launcher (torchrun) still running?".format(
                                         self.rank, host, port, startup_timeout.total_seconds(),
                                         str(e).splitlines()[0] if str(e) else type(e).__name__)) from None
        self.store = dist.PrefixStore(self._prefix("work"), self.base)
        logger.info("fairseq-stream bulk: joined the job as rank %d of %d", self.rank, self.world)

    @staticmethod
    def _prefix(name: str) -> str:
        # torchrun --max-restarts restarts the workers with the agent's store
        # (and its counters) kept: each restart counts chunks afresh.
        return "fairseq_stream_bulk/{}/{}".format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), name)

    def second_client(self):
        """A store of its own for the progress thread (a store client is not shared across threads)."""
        if self._address is None:
            return self.store
        return dist.PrefixStore(self._prefix("work"), dist.TCPStore(
            self._address[0], self._address[1], self.world, is_master=False, timeout=self.startup_timeout,
            wait_for_workers=False))

    def get_index(self) -> "ch.InputIndex":
        """Rank 0's input index, on the other ranks (it is set right after start-up)."""
        try:
            self.store.wait([INDEX], self.startup_timeout)
        except RuntimeError as e:
            raise FairseqStreamError("rank {} got no input index from rank 0 within {:.0f} s ({})".format(
                self.rank, self.startup_timeout.total_seconds(), str(e).splitlines()[0] if str(e) else "")) from None
        return ch.InputIndex.from_json(self.store.get(INDEX).decode("utf-8"))

    def finish(self):
        """Tell the others this rank has written its last chunk; on rank 0, wait until every rank has."""
        if self.world == 1:
            return
        if self.store.add(RANKS_DONE, 1) == self.world:
            self.store.set(ALL_DONE, "1")
        if self.rank == 0:
            self.store.wait([ALL_DONE], STORE_TIMEOUT)

    def close(self):
        """Nothing to tear down: the store's connection closes with the process."""


def run(input_path: str, output: str, work_dir: str, chunk_size: int, settings: JobSettings,
        fmt: str = "text", pool: int = 64, batch_size: Optional[int] = None, maxi_batch: int = 1,
        cpu: bool = False, trust_checkpoint: bool = False, progress: bool = True,
        long_lines: str = "error", startup_timeout: timedelta = STARTUP_TIMEOUT) -> Optional[dict]:
    """Translate ``input_path`` into ``output`` as this rank of the job; rank 0 merges.

    ``long_lines``: what to do with a line longer than the model's positions:
    ``error`` (stop, naming its line in the file), ``skip`` (an empty output
    line, no score) or ``truncate`` (translate its longest prefix of whole
    words that fits).

    Returns the merge's summary on rank 0 (see :func:`~fairseq_stream.bulk.chunks.merge`), None on the
    other ranks.
    """
    if fmt not in ch.FORMATS:
        raise FairseqStreamError("--format must be one of {}, got {}".format(", ".join(ch.FORMATS), fmt))
    if long_lines not in LONG_LINES:
        raise FairseqStreamError("--long-lines must be one of {}, got {}".format(", ".join(LONG_LINES), long_lines))
    started = time.perf_counter()
    ranks = Ranks(use_cuda=torch.cuda.is_available() and not cpu, startup_timeout=startup_timeout)
    held = _WorkDir(work_dir)
    try:
        if ranks.rank == 0:
            ch.check_output(output)  # before hours of work, not after
            index = ch.index_input(input_path, chunk_size)
            held.take()
            ranks.store.set(INDEX, index.to_json())
        else:
            index = ranks.get_index()
        settings_sha = settings.digest()
        translator = settings.translator(pool=pool, batch_size=batch_size, maxi_batch=maxi_batch, cpu=cpu,
                                         trust_checkpoint=trust_checkpoint)
        loaded = time.perf_counter()
        bar = _ProgressBar(ranks, index.lines) if progress and ranks.rank == 0 else None
        try:
            worker = _Worker(ranks, index, work_dir, settings_sha, translator, long_lines,
                             nbest=int(settings.options.get("nbest", 1)))
            worker.work()
            finished = time.perf_counter()
            logger.info("fairseq-stream bulk: rank %d translated %d chunk(s), found %d done; %d sentences in "
                        "%.2f s after %.2f s of start-up", ranks.rank, worker.done, worker.skipped,
                        worker.sentences, finished - loaded, loaded - started)
            ranks.finish()  # every chunk is written
        finally:
            if bar is not None:
                bar.close()
        if ranks.rank != 0:
            return None
        merging = time.perf_counter()
        summary = ch.merge(index, work_dir, settings_sha, output, fmt)
        logger.info("fairseq-stream bulk: waited %.2f s for the other ranks, merged %d lines in %.2f s",
                    merging - finished, index.lines, time.perf_counter() - merging)
        return summary
    except BaseException:
        held.remove_if_empty()
        raise
    finally:
        held.release()
        ranks.close()


class _WorkDir:
    """Rank 0's hold on the work dir for a run: made where missing, locked against a second run."""

    def __init__(self, path: str):
        self.path = path
        self.made: List[str] = []  # the directories this run created, removed if it fails before writing
        self.lock: Optional[int] = None

    def take(self):
        """Make ``path/chunks`` (an unwritable place fails now, not at chunk 1) and lock ``path``."""
        self.made = _make_dirs(os.path.join(self.path, "chunks"))
        self.lock = _lock_work_dir(self.path)

    def remove_if_empty(self):
        """A failed run leaves no empty work dir of its making (:func:`_remove_empty`)."""
        _remove_empty(self.made)

    def release(self):
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


def _lock_work_dir(work_dir: str) -> Optional[int]:
    """Hold ``work_dir`` for this run (an exclusive ``flock`` on the directory, released when the process
    ends); a one-line error where another run holds it.

    Two runs into one work dir each translated every chunk, and with other
    settings both then failed at the merge, each finding the other's chunks
    stale. Where the file system takes no lock (some network file systems),
    the run goes on without one.
    """
    import fcntl

    fd = os.open(work_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FairseqStreamError("another fairseq-stream-bulk run is translating into {}; wait for it to end, "
                                 "or give this one another --output or --work-dir".format(work_dir)) from None
    except OSError as e:
        os.close(fd)
        logger.warning("fairseq-stream bulk: cannot lock %s (%s); two runs into it would each do every chunk",
                       work_dir, e.strerror or e)
        return None
    return fd


def _make_dirs(path: str) -> List[str]:
    """``os.makedirs(path)``; the directories it created, deepest first."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    os.makedirs(missing[0] if missing else path, exist_ok=True)
    return missing


def _remove_empty(dirs: List[str]):
    """Remove each of ``dirs`` (deepest first) that is still empty: a failed run leaves no empty work dir."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:  # written into (kept, for the re-run to resume), or already gone
            return


class _Worker:
    """Takes chunks from the shared counter until none is left, translating those not done yet."""

    def __init__(self, ranks: Ranks, index: ch.InputIndex, work_dir: str, settings_sha: str, translator,
                 long_lines: str, nbest: int = 1):
        self.ranks, self.index, self.work_dir, self.settings_sha = ranks, index, work_dir, settings_sha
        self.translator, self.long_lines, self.nbest = translator, long_lines, nbest
        self.done = self.skipped = self.sentences = 0

    def work(self):
        """Translate chunks until the counter passes the last one."""
        while self.take_one():
            pass

    def take_one(self) -> bool:
        """Take the next free chunk from the shared counter and do it; False once none is left."""
        i = self.ranks.store.add(NEXT_CHUNK, 1) - 1
        if i >= self.index.chunks:
            return False
        self._chunk(i)
        return True

    def _chunk(self, i: int):
        data, lines = ch.read_chunk(self.index, i)
        input_sha = ch.sha256(data)
        if ch.chunk_done(self.work_dir, i, input_sha, self.settings_sha, len(lines), self.long_lines):
            self.ranks.store.add(SENTENCES_DONE, len(lines))
            self.skipped += 1
            return
        sources, long = self._fitted(lines, first_line=i * self.index.chunk_size + 1)
        results: List[Optional[dict]] = [None] * len(lines)
        for j in long:
            if sources[j] is None:  # skipped: still one (empty) output line
                results[j] = {"text": "", "score": None, "long": "skip"}
        todo = [j for j, s in enumerate(sources) if s is not None]
        pending = len(lines) - len(todo)
        for t in self.translator.translate(sources[j] for j in todo):
            results[todo[t.index]] = self._record(t, "truncate" if todo[t.index] in long else None)
            pending += 1
            if pending >= PROGRESS_EVERY:
                self.ranks.store.add(SENTENCES_DONE, pending)
                pending = 0
        if pending:
            self.ranks.store.add(SENTENCES_DONE, pending)
        ch.write_chunk(self.work_dir, i, input_sha, self.settings_sha, results, self.long_lines, len(long))
        self.done += 1
        self.sentences += len(lines)

    def _fitted(self, lines: List[str], first_line: int):
        """(the lines to translate, None for a skipped one; the set of indices of over-long lines).

        Checked here, not left to the Translator, so that an error names the
        line in the input file rather than its place in the chunk.
        """
        limit = self.translator.max_positions
        sources, long = list(lines), set()
        for j, line in enumerate(lines):
            tokens = self.translator.encode(line).numel()
            if tokens <= limit:
                continue
            if self.long_lines == "error":
                raise FairseqStreamError(
                    "input line {} has {} tokens, more than the model's {} positions; shorten or split it, "
                    "or give --long-lines skip or --long-lines truncate".format(first_line + j, tokens, limit))
            long.add(j)
            sources[j] = None if self.long_lines == "skip" else _truncated(self.translator, line, limit)
        return sources, long

    def _record(self, t, long: Optional[str]) -> dict:
        record = {"text": t.text, "score": t.score}
        if self.nbest > 1:  # every hypothesis, best first, for --format generate
            record["hypotheses"] = [[float(h["score"]), self.translator.decode(h["tokens"])]
                                    for h in t.hypotheses[:self.nbest]]
        if long:
            record["long"] = long
        return record


def _truncated(translator, line: str, limit: int) -> str:
    """The longest prefix of whole (space-separated) words of ``line`` whose encoding fits ``limit`` tokens."""
    words = line.split(" ")
    low, high = 0, len(words)  # a prefix of `low` words fits; one of `high + 1` words does not
    while low < high:
        middle = (low + high + 1) // 2
        if translator.encode(" ".join(words[:middle])).numel() <= limit:
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])


class _ProgressBar:
    """Rank 0's bar over the whole job, fed by the store's counter from a thread of its own."""

    def __init__(self, ranks: Ranks, total: int):
        from tqdm import tqdm

        self._store = ranks.second_client()
        self._bar = tqdm(total=total, unit="sent", desc="fairseq-stream bulk ({} rank{})".format(
            ranks.world, "" if ranks.world == 1 else "s"), dynamic_ncols=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="bulk-progress", daemon=True)
        self._thread.start()

    def _follow(self):
        while not self._stop.wait(0.5):
            self._show()

    def _show(self):
        try:
            value = self._store.add(SENTENCES_DONE, 0)
        except Exception:  # the store went away (the job is ending): nothing more to show
            return
        self._bar.update(value - self._bar.n)

    def close(self):
        self._stop.set()
        self._thread.join()
        self._show()
        self._bar.close()
