"""``--generator stream``: VAR-STREAM's refill-at-ε scheduling inside fairseq's tools.

fairseq-generate hands a generator one batch at a time and prints each
batch's translations before asking for the next. To refill from *later*
batches, the generator reads ahead: it builds its own copy of
fairseq-generate's batch iterator (same dataset, same batching arguments,
``shuffle=False``), streams through it with a
:class:`~fairseq_stream.schedule.pool.StreamPool`, keeps the translations that
finish early, and answers each ``generate(sample)`` once every sentence of
that sample is done. Each sentence is printed exactly once, by fairseq, in
fairseq's order, and fairseq's progress bar and counts stay right.

The look-ahead is used only when the first sample asked for is exactly the
first batch of that iterator; otherwise (fairseq-interactive, whose samples
carry no ``id``, or any other caller) the pool streams within each sample:
give it a large batch (``--batch-size`` = ``--buffer-size`` in
fairseq-interactive) and a smaller ``--stream-pool``.
"""

import logging
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.inference_mode import decoding, released
from fairseq_stream.option_field import option
from fairseq_stream.engine import CohortDecoder
from fairseq_stream.schedule.pool import DEFAULT_MAX_WAIT, StreamPool, check_pool_options
from fairseq_stream.schedule.read_ahead import encoder_queue_for, read_ahead
from fairseq_stream.schedule.wrapper import DecoderWrapper

logger = logging.getLogger(__name__)

# Read-ahead results kept per pool sentence before fairseq-generate's look-ahead pauses.
CACHED_PER_POOL_SENTENCE = 4

RefillUnit = ChoiceEnum(["sentences", "rows"])
CapacityUnit = ChoiceEnum(["rows", "tokens"])


@dataclass
class StreamOptions(FairseqDataclass):
    """Options of the streaming scheduler (also part of the ``--search var-stream`` preset)."""

    stream_eps: str = option("1/6", "refill threshold epsilon in (0, 1], a fraction (1/6) or a decimal: refill the "
                             "pool when at most epsilon * --stream-pool sentences are active")
    stream_pool: Optional[int] = option(None, "n, the most sentences decoded at once (default: --batch-size, else the "
                                        "first batch's size); memory is bounded by it, not by the input size")
    stream_refill_unit: RefillUnit = option("sentences", "what epsilon counts: sentences (the paper) or rows (live "
                                            "hypotheses, refill at epsilon * n * beam)")
    stream_capacity: Optional[int] = option(None, "at most this many decoder rows (or tokens, see "
                                            "--stream-capacity-unit) per decoder call; larger groups are split "
                                            "(default: no limit)")
    stream_capacity_unit: CapacityUnit = option("rows", "unit of --stream-capacity: rows (total beam width) or tokens "
                                                "(rows x current prefix length, which bounds self-attention work)")
    stream_max_wait: int = option(DEFAULT_MAX_WAIT, "latency guard: once a sentence has been passed over this many "
                                  "decoder calls since it entered the pool, it is expanded in every call, whatever "
                                  "its length (0: off)")
    stream_max_cached: Optional[int] = option(None, "fairseq-generate: stop reading later batches while more than "
                                              "this many finished translations wait for an earlier batch to finish "
                                              "(default: 4 x the pool)")
    stream_within_batch: bool = option(False, "do not read ahead into later batches of fairseq-generate; refill only "
                                       "from the batch being translated")
    encoder_queue: Optional[int] = option(None, "run the encoder ahead in a background thread (on a GPU, on a CUDA "
                                          "stream of its own), up to this many encoded batches waiting for the pool "
                                          "(0: encode in the decoder's thread when the pool refills; default: 2 on "
                                          "the CPU where torch's threads leave a core free, where it was measured to "
                                          "help, else 0)")


@dataclass
class FifoOptions(StreamOptions):
    """The stream options of ``--generator fifo``; each decoder call takes the longest prefixes first, padded."""


def parse_eps(text, flag: str = "--stream-eps") -> float:
    """Parse ``--stream-eps`` (``1/6``, ``0.25``), or the option ``flag``, into a float in (0, 1]."""
    try:
        value = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        raise FairseqStreamError("{} must be a number or fraction in (0, 1], got {!r}".format(flag, text))
    if not (0.0 < value <= 1.0):
        raise FairseqStreamError("{} must be in (0, 1], got {}".format(flag, text))
    return value


def pool_settings(options, order: str = "shortest", refill_eps: Optional[Callable[[Any], float]] = None) -> dict:
    """The :class:`StreamPool` keyword arguments of stream ``options``, checked (one-line errors).

    ``options`` is a :class:`StreamOptions` or anything with its fields (the
    parsed command line); the pool size is not among the arguments.
    ``refill_eps``: reads ε from options of a scheduler's own (top-up's,
    :func:`fairseq_stream.schedule.topup.refill_eps`); None reads ``--stream-eps``.
    """
    if options.stream_pool is not None and options.stream_pool < 1:
        raise FairseqStreamError("--stream-pool must be at least 1, got {}".format(options.stream_pool))
    max_cached = getattr(options, "stream_max_cached", None)
    if max_cached is not None and max_cached < 0:
        raise FairseqStreamError("--stream-max-cached must be >= 0, got {}".format(max_cached))
    eps = parse_eps(options.stream_eps) if refill_eps is None else refill_eps(options)
    settings = dict(
        eps=eps,
        refill_unit=str(options.stream_refill_unit),
        capacity=options.stream_capacity,
        capacity_unit=str(options.stream_capacity_unit),
        max_wait=options.stream_max_wait,
        order=order,
    )
    check_pool_options(options.stream_pool or 1, **settings)
    encoder_queue = getattr(options, "encoder_queue", None)
    if encoder_queue is not None and encoder_queue < 0:
        raise FairseqStreamError("--encoder-queue must be >= 0, got {}".format(encoder_queue))
    return settings


class StreamGenerator(DecoderWrapper):
    """A fairseq generator that decodes through a :class:`StreamPool`.

    Args:
        decoder: the :class:`~fairseq_stream.engine.CohortDecoder` (a
            :class:`~fairseq_stream.decoder.BeamDecoder`) with the search.
        options: a :class:`StreamOptions` (or any object with its fields).
        batches: a callable returning fairseq-generate's batch iterator for the
            look-ahead, or None to stream within each sample only.
        batch_size: the ``--batch-size`` fairseq batches with (default pool size).
        pool_args: the pool's settings, as the scheduler entry reads them from
            ``options`` (its order, its refill threshold); None:
            :func:`pool_settings` of ``options`` (shortest first, ``--stream-eps``).
    """

    def __init__(self, decoder: CohortDecoder, options, batches=None, batch_size: Optional[int] = None,
                 pool_args: Optional[dict] = None):
        self.decoder = decoder
        self.pool_args = pool_settings(options) if pool_args is None else pool_args
        self.pool_size = options.stream_pool or batch_size
        self.max_cached = getattr(options, "stream_max_cached", None)
        self._batches = None if options.stream_within_batch else batches
        self.encoder_queue = getattr(options, "encoder_queue", None)
        self._lookahead = None  # None: not decided yet
        self._stream = None
        self._encoded = None
        self._results = {}

    def cuda(self):
        self.decoder.cuda()
        return self

    @property
    def reads_ahead(self) -> bool:
        """Whether this generator streams across fairseq-generate's batches (its look-ahead is on)."""
        return self._batches is not None

    def pool(self, default_size: int) -> StreamPool:
        return StreamPool(self.decoder, self.pool_size or default_size, **self.pool_args)

    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        """Translate a fairseq sample; one list of hypotheses per sentence, in sample order."""
        self.decoder.check_call(prefix_tokens, constraints)
        start = time.perf_counter()
        ids = sample.get("id")
        # The look-ahead's pool and encoder thread live across calls; each call resumes them in the mode.
        with decoding():
            if ids is not None and self._use_lookahead(sample, bos_token):
                results = self._answer(ids.tolist())
            else:
                results = self._within(sample, bos_token)
        self.stats.add_sentences(len(results), time.perf_counter() - start, results)
        return [released(hypotheses) for hypotheses in results]

    # -- within one sample -----------------------------------------------------

    def _within(self, sample, bos_token):
        net_input = sample["net_input"]
        n = net_input["src_tokens"].size(0)
        cohort = self.decoder.open(net_input, bos_token=bos_token)
        done = dict(self.pool(n).run([cohort]))
        return [done[i] for i in range(n)]

    # -- across fairseq-generate's batches -----------------------------------------

    def _use_lookahead(self, sample, bos_token) -> bool:
        if self._lookahead is None:
            self._lookahead = self._start_lookahead(sample, bos_token)
        return self._lookahead

    def _start_lookahead(self, sample, bos_token) -> bool:
        itr = self._batches() if self._batches is not None else None
        if itr is None:
            return False
        first = next(iter(itr), None)
        if first is None or not torch.equal(first["id"].cpu(), sample["id"].cpu()):
            logger.info("fairseq-stream: the batches are not fairseq-generate's; streaming within each batch")
            return False
        device = sample["net_input"]["src_tokens"].device

        def cohorts():
            # With --encoder-queue this runs in the encoder thread.
            # The ids from the look-ahead's own batches, on the host (the first's equal fairseq's): a
            # cohort's ids are then never read back from the device.
            yield self.decoder.open(sample["net_input"], ids=first["id"], bos_token=bos_token)
            for batch in itr:
                if "net_input" not in batch:
                    continue
                net_input = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch["net_input"].items()}
                yield self.decoder.open(net_input, ids=batch["id"], bos_token=bos_token)

        pool = self.pool(first["id"].numel())
        limit = self.max_cached if self.max_cached is not None else CACHED_PER_POOL_SENTENCE * pool.pool_size
        # Reading ahead only pays while the pool has room; past the limit the
        # pool decodes what it holds, so memory follows the pool, not the input.
        queue = encoder_queue_for(self.encoder_queue, device)
        # The encoder thread holds the batches queued and the one it encoded next (waiting for room).
        pool.encoded_ahead = queue + 1 if queue else 0
        pool.longest_source = getattr(self._batches, "longest_source", None)
        self._encoded = read_ahead(cohorts(), queue, device)
        self._stream = pool.run(self._encoded, may_read=lambda: len(self._results) < limit)
        return True

    def close(self):
        """Stop the look-ahead (and its encoder thread); fairseq-generate never calls it, exit does."""
        if self._encoded is not None:
            self._encoded.close()

    def _answer(self, wanted):
        while any(i not in self._results for i in wanted):
            try:
                item = next(self._stream, None)
            except BaseException:
                # An error on either side (KeyboardInterrupt too) stops the encoder thread first.
                self.close()
                raise
            if item is None:
                missing = [i for i in wanted if i not in self._results]
                raise FairseqStreamError(
                    "the look-ahead iterator never produced sentence(s) {} (use --stream-within-batch)"
                    .format(missing[:5]))
            self._results[item[0]] = item[1]
            self.stats.peak_cached = max(self.stats.peak_cached, len(self._results))
        return [self._results.pop(i) for i in wanted]


def fairseq_generate_batches(task, models, cfg):
    """A callable building fairseq-generate's epoch iterator again (for the look-ahead).

    Same arguments as ``fairseq_cli/generate.py``, with the iterator cache
    disabled so that fairseq's own iterator is untouched, and with no worker
    process (see below). None where the generation subset is not loaded
    (fairseq-interactive, the Python API). Its ``longest_source`` is the
    subset's longest source (tokens, from the data set's sizes), which the
    pool's memory is sized for at the decode's start.
    """
    from fairseq import utils

    dataset_cfg = getattr(cfg, "dataset", None)
    if dataset_cfg is None:
        return None
    subset = getattr(dataset_cfg, "gen_subset", None)
    if subset is None or subset not in getattr(task, "datasets", {}):
        return None

    def build():
        return task.get_batch_iterator(
            dataset=task.dataset(subset),
            max_tokens=dataset_cfg.max_tokens,
            max_sentences=dataset_cfg.batch_size,
            max_positions=utils.resolve_max_positions(
                task.max_positions(), *[m.max_positions() for m in models]
            ),
            ignore_invalid_inputs=dataset_cfg.skip_invalid_size_inputs_valid_test,
            required_batch_size_multiple=dataset_cfg.required_batch_size_multiple,
            seed=cfg.common.seed,
            num_shards=cfg.distributed_training.distributed_world_size,
            shard_id=cfg.distributed_training.distributed_rank,
            # No worker process, whatever --num-workers says. fairseq's BufferedIterator stops
            # reading at the epoch's length without exhausting the DataLoader, so where the pool
            # is done with the look-ahead mid-run (one batch holds the input), the DataLoader's
            # iterator is left to the cyclic garbage collector. There the weakref finalizers of
            # its index queues stop their feeder threads before its __del__ can tell the worker
            # to exit, and torch waits out its 5 s join timeout (issue 49.2). Reading and
            # collating the batches again costs milliseconds next to decoding them; the
            # BufferedIterator's thread still reads ahead.
            num_workers=0,
            data_buffer_size=dataset_cfg.data_buffer_size,
            disable_iterator_cache=True,
        ).next_epoch_itr(shuffle=False)

    sizes = getattr(task.dataset(subset), "src_sizes", None)
    build.longest_source = int(sizes.max()) if sizes is not None and len(sizes) else None
    return build


def build_stream_generator(decoder, task, models, gen_cfg, options, pool_args: Optional[dict] = None):
    """Wrap ``decoder`` in a :class:`StreamGenerator` (its pool on ``pool_args``) with fairseq-generate's
    look-ahead when available."""
    from omegaconf import DictConfig

    root = gen_cfg._get_root() if isinstance(gen_cfg, DictConfig) else None
    batches = fairseq_generate_batches(task, models, root) if root is not None else None
    batch_size = getattr(getattr(root, "dataset", None), "batch_size", None) if root is not None else None
    return StreamGenerator(decoder, options, batches=batches, batch_size=batch_size, pool_args=pool_args)
