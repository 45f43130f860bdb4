"""One rank of a bulk translation job, on torch.distributed (launched by torchrun, or alone).

Every rank loads the model once, then takes chunks from a shared counter in
the torch.distributed store (an atomic ``add``: a rank that finishes takes
the next free chunk, so fast ranks take more), skips chunks already done by
an earlier run (:func:`~fairseq_stream.bulk.chunks.chunk_done`), translates
the others with :class:`~fairseq_stream.api.Translator` (any of our searches,
streaming within the rank) and writes them atomically. Rank 0 shows one
progress bar for the whole job (sentences done by all ranks, from a second
counter in the store), waits for the others at a barrier, and merges the
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

# The store's keys; a PrefixStore keeps them apart from the process group's.
NEXT_CHUNK, SENTENCES_DONE, INDEX = "next_chunk", "sentences_done", "input_index"
PROGRESS_EVERY = 64  # sentences between a rank's progress reports to the store
STORE_TIMEOUT = timedelta(hours=24)  # rank 0 indexes the input while the others wait


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


class Ranks:
    """This process's place in the job: rank, world size, the shared store, the device."""

    def __init__(self, use_cuda: bool):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            # Before the process group: nccl's collectives use the current device.
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
        self.base = dist.TCPStore(host, port, self.world, is_master=(self.rank == 0 and not agent),
                                  timeout=STORE_TIMEOUT, wait_for_workers=False)
        backend = "nccl" if use_cuda and dist.is_nccl_available() else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(self._prefix("pg"), self.base), rank=self.rank,
                                world_size=self.world, timeout=STORE_TIMEOUT)
        self.store = dist.PrefixStore(self._prefix("work"), self.base)

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
            self._address[0], self._address[1], self.world, is_master=False, timeout=STORE_TIMEOUT,
            wait_for_workers=False))

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def close(self):
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run(input_path: str, output: str, work_dir: str, chunk_size: int, settings: JobSettings,
        fmt: str = "text", pool: int = 64, batch_size: Optional[int] = None, maxi_batch: int = 1,
        cpu: bool = False, trust_checkpoint: bool = False, progress: bool = True) -> Optional[str]:
    """Translate ``input_path`` into ``output`` as this rank of the job; rank 0 merges.

    Returns the output path on rank 0, None on the other ranks.
    """
    from fairseq_stream.api import Translator

    if fmt not in ch.FORMATS:
        raise FairseqStreamError("--format must be one of {}, got {}".format(", ".join(ch.FORMATS), fmt))
    started = time.perf_counter()
    ranks = Ranks(use_cuda=torch.cuda.is_available() and not cpu)
    try:
        if ranks.rank == 0:
            index = ch.index_input(input_path, chunk_size)
            os.makedirs(os.path.join(work_dir, "chunks"), exist_ok=True)
            ranks.store.set(INDEX, index.to_json())
        else:
            index = ch.InputIndex.from_json(ranks.store.get(INDEX).decode("utf-8"))
        settings_sha = settings.digest()
        translator = Translator(settings.paths, data=settings.data, search=settings.search, beam=settings.beam,
                                pool=pool, batch_size=batch_size, maxi_batch=maxi_batch, bpe=settings.bpe,
                                tokenizer=settings.tokenizer,
                                sentencepiece_model=settings.sentencepiece_model, bpe_codes=settings.bpe_codes,
                                cpu=cpu, trust_checkpoint=trust_checkpoint, **settings.options)
        loaded = time.perf_counter()
        bar = _ProgressBar(ranks, index.lines) if progress and ranks.rank == 0 else None
        try:
            done, skipped, sentences = _work(ranks, index, work_dir, settings_sha, translator)
            finished = time.perf_counter()
            logger.info("fairseq-stream bulk: rank %d translated %d chunk(s), found %d done; %d sentences in "
                        "%.2f s after %.2f s of start-up", ranks.rank, done, skipped, sentences, finished - loaded,
                        loaded - started)
            ranks.barrier()  # every chunk is written
        finally:
            if bar is not None:
                bar.close()
        if ranks.rank != 0:
            return None
        merging = time.perf_counter()
        ch.merge(index, work_dir, settings_sha, output, fmt)
        logger.info("fairseq-stream bulk: waited %.2f s for the other ranks, merged %d lines in %.2f s",
                    merging - finished, index.lines, time.perf_counter() - merging)
        return output
    finally:
        ranks.close()


def _work(ranks: Ranks, index: ch.InputIndex, work_dir: str, settings_sha: str, translator):
    """Take chunks from the shared counter until none is left; (translated, found done, sentences translated)."""
    done = skipped = sentences = 0
    while True:
        i = ranks.store.add(NEXT_CHUNK, 1) - 1
        if i >= index.chunks:
            return done, skipped, sentences
        data, lines = ch.read_chunk(index, i)
        input_sha = ch.sha256(data)
        if ch.chunk_done(work_dir, i, input_sha, settings_sha, len(lines)):
            ranks.store.add(SENTENCES_DONE, len(lines))
            skipped += 1
            continue
        results: List[Optional[dict]] = [None] * len(lines)
        pending = 0
        for t in translator.translate(lines):
            results[t.index] = {"text": t.text, "score": t.score}
            pending += 1
            if pending == PROGRESS_EVERY:
                ranks.store.add(SENTENCES_DONE, pending)
                pending = 0
        if pending:
            ranks.store.add(SENTENCES_DONE, pending)
        ch.write_chunk(work_dir, i, input_sha, settings_sha, results)
        done += 1
        sentences += len(lines)


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
