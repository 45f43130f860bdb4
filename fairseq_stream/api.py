"""Python API: stream sentences through any fairseq translation checkpoint(s).

    from fairseq_stream.api import Translator

    translator = Translator(["m1.pt", "m2.pt"], data="data-bin", bpe="sentencepiece",
                            sentencepiece_model="spm.model", beam=5)
    for t in translator.translate(open("input.txt")):
        print(t.index, t.text)

Sentences are read lazily from any iterable (a list, a file, a generator) in
chunks of ``batch_size``; each chunk is encoded as one batch and streamed
through a pool of ``pool`` sentences, so memory is bounded by the pool and
the chunk size, never by the input. Results are yielded as they finish (not
in input order), each with its input ``index``.
"""

import os
import typing
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Union

import torch

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.inference_mode import decoding, released
from fairseq_stream.engine import CohortDecoder
from fairseq_stream.schedule.read_ahead import encoder_queue_for, read_ahead
from fairseq_stream.text_input import check_sentence, text_lines


# Stream options of fairseq-generate's that the API has no use for, and why.
COMMAND_LINE_ONLY = {
    "stream_pool": "give pool=N",
    "stream_max_cached": "it bounds fairseq-generate's read-ahead; the API reads its input lazily",
    "stream_within_batch": "it turns off fairseq-generate's read-ahead; the API reads its input lazily",
}


@dataclass
class Translation:
    """One input sentence's result."""

    index: int  # position in the input
    source: str
    text: str  # best hypothesis, detokenized
    score: float  # its length-normalized log-probability (natural log)
    # fairseq's n-best dicts (tokens, score, positional_scores, ...), best first, as fairseq orders them;
    # every hypothesis the search kept, or the first ``nbest`` where that option was given.
    hypotheses: List[dict]


class Translator:
    """Load a checkpoint (or an ensemble) and translate text with one of our searches.

    Args:
        paths: checkpoint file(s); several make an ensemble.
        data: the data-bin directory with the dictionaries (default: the
            one recorded in the checkpoint).
        search: ``var-stream`` (default), ``var``, ``var-batch``, ``fixed``
            or ``greedy``; always decoded through the streaming pool.
        beam: k.
        pool: n, sentences decoded at once.
        batch_size: sentences encoded together (default: ``pool``).
        maxi_batch: m: read m x ``batch_size`` sentences, sort them by
            length, then cut batches (Marian's maxi-batch); 1 (default):
            batches in input order, unsorted (mini-batching).
        bpe, tokenizer, sentencepiece_model, bpe_codes: fairseq's
            ``--bpe``/``--tokenizer`` options (default: the checkpoint's).
        cpu: keep the models on the CPU even if CUDA is available.
        trust_checkpoint: load these files with the full unpickler (trusted
            files only); applies to this load alone.
        options: further search or stream options by their dataclass name,
            e.g. ``prune_ap=2.0``, ``stream_eps="1/4"``, ``lenpen=1.2``
            (generation options such as ``lenpen`` and ``max_len_b`` too);
            ``nbest=N`` keeps the best N of each sentence's hypotheses
            (default: all the search kept). ``cpu_workers=N`` decodes
            batches on N forked worker processes at once, results in
            input order (default 1: the pool streams across every
            batch; with workers each batch is streamed on its own, so
            float32 scores may move in the last bits, int8's do not;
            :mod:`fairseq_stream.schedule.workers`); the workers are
            forked by the first :meth:`translate` call and kept for the
            next ones until :meth:`close` (or the end of a ``with``
            block, or of the process). ``host_lag=N`` reads
            each step's summary N decoder calls late (greedy and
            ``fixed`` on ``runner="static"`` or ``"lean"``;
            :mod:`fairseq_stream.late_reads`); ``cuda_graphs="off"`` keeps
            ``runner="static"``'s step eager on CUDA (default ``auto``:
            captured, :mod:`fairseq_stream.runners.step_graphs`).
            All options are checked before the checkpoints are loaded, each
            by the type its field (or this signature) declares; a string is
            read as the command line reads it (``beam="5"`` is 5), a value
            that fits no such reading (``beam=2.5``, ``lenpen=None``) is a
            one-line error (:mod:`fairseq_stream.option_types`);
            fairseq-generate's read-ahead options are refused here.
    """

    def __init__(self, paths: Union[str, Sequence[str]], data: Optional[str] = None,
                 search: str = "var-stream", beam: int = 5, pool: int = 64,
                 batch_size: Optional[int] = None, maxi_batch: int = 1, bpe: Optional[str] = None,
                 tokenizer: Optional[str] = None, sentencepiece_model: Optional[str] = None,
                 bpe_codes: Optional[str] = None, cpu: bool = False,
                 trust_checkpoint: bool = False, **options):
        import fairseq_stream  # noqa: F401  (registries, safe loading)
        from fairseq_stream.build import build_decoder, cpu_layout_of, spec_from_options
        from fairseq_stream.schedule.pool import StreamPool
        from fairseq_stream.schedule.stream import pool_settings

        # Every option is checked before any model is loaded (a WMT'19 ensemble takes a minute to load).
        paths = _checked_paths(paths)
        (search, beam, pool, batch_size, maxi_batch, bpe, tokenizer, sentencepiece_model, bpe_codes, data, cpu,
         trust_checkpoint) = _typed_arguments(search=search, beam=beam, pool=pool, batch_size=batch_size,
                                              maxi_batch=maxi_batch, bpe=bpe, tokenizer=tokenizer,
                                              sentencepiece_model=sentencepiece_model, bpe_codes=bpe_codes,
                                              data=data, cpu=cpu, trust_checkpoint=trust_checkpoint)
        _check_sizes(pool, batch_size, maxi_batch)
        options = _typed_options(search, options)
        # The API's scheduler is its own streaming pool (below): of the spec, only the decoder is built.
        spec, stream_cfg = spec_from_options(search, beam, options)
        self._pool_args = pool_settings(stream_cfg)
        self.models, self.cfg, self.task, self.device = _load_models(paths, data, trust_checkpoint, cpu)
        self.decoder = build_decoder(spec, self.task, self.models)
        self.layout = cpu_layout_of(self.decoder)  # cpu_workers > 1: translate() decodes on worker processes
        self.pool_size = pool
        self.batch_size = batch_size or pool
        self.maxi_batch = maxi_batch
        self.nbest = options.get("nbest")  # None: every hypothesis the search kept
        self.encoder_queue = encoder_queue_for(stream_cfg.encoder_queue, self.device)
        self._make_pool = lambda: StreamPool(self.decoder, pool, **self._pool_args)
        self.tokenizer, self.bpe = _text_codecs(self.cfg, tokenizer, bpe, sentencepiece_model, bpe_codes)
        self.max_positions = min(_first(self.task.max_positions()), *(_first(m.max_positions()) for m in self.models))
        self._kept_workers = None  # cpu_workers: the processes kept between translate() calls
        self._workers_busy = False  # a translate() call is reading from them

    def close(self):
        """End the worker processes ``cpu_workers`` keeps between :meth:`translate` calls (idempotent).

        They also end when the Translator is collected, and at exit; a
        Translator used after :meth:`close` forks new ones.
        """
        self._end_kept_workers(wait=not self._workers_busy)

    def _end_kept_workers(self, wait: bool):
        workers, self._kept_workers = self._kept_workers, None
        if workers is not None:
            self._workers_finalizer.detach()
            workers.close(wait=wait)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def stats(self):
        """The decoder's counters (timesteps, expansions, refills ...)."""
        return self.decoder.stats

    def encode(self, sentence: str) -> torch.Tensor:
        """Source token ids of one sentence (tokenizer, BPE, dictionary, EOS)."""
        text = sentence.rstrip("\n")
        if self.tokenizer is not None:
            text = self.tokenizer.encode(text)
        if self.bpe is not None:
            text = self.bpe.encode(text)
        return self.task.source_dictionary.encode_line(text, add_if_not_exist=False).long()

    def decode(self, tokens: torch.Tensor) -> str:
        """Text of target token ids (dictionary, BPE, detokenizer)."""
        text = self.task.target_dictionary.string(tokens.int().cpu())
        if self.bpe is not None:
            text = self.bpe.decode(text)
        if self.tokenizer is not None:
            text = self.tokenizer.decode(text)
        return text

    def translate(self, sentences: Iterable[str]) -> Iterator[Translation]:
        """Yield one :class:`Translation` per input sentence, as each finishes.

        ``sentences`` is any iterable of ``str`` (a list, an open text file, a
        generator), one sentence each. A single ``str`` is refused rather than
        translated character by character: pass ``[text]``.

        Raises:
            FairseqStreamError: an input is not a ``str`` or not valid UTF-8
                text, reading the input failed, or a sentence is longer than
                the model's positions; the message names the sentence.
        """
        if isinstance(sentences, (str, bytes)):
            raise FairseqStreamError(
                "translate() takes an iterable of sentences, not a single {}; pass [text]"
                .format(type(sentences).__name__))
        try:
            items = iter(sentences)
        except TypeError:
            raise FairseqStreamError("translate() takes an iterable of sentences, not a {}"
                                     .format(type(sentences).__name__)) from None
        return self._translate(items)

    def _translate(self, items: Iterator) -> Iterator[Translation]:
        sources = {}
        batches = self._batches(_numbered(items), sources)
        on_workers = self.layout is not None and self.layout.workers > 1
        finished, closer = self._on_workers(batches) if on_workers else self._finished(batches, self.encoder_queue)
        kept = on_workers and closer is self._kept_workers
        completed = False
        try:
            while True:
                # Decoding runs in the mode, one translation at a time; the caller's code between
                # two translations does not (a mode entered around a yield would hold there too).
                with decoding():
                    pair = next(finished, None)
                if pair is None:
                    completed = True
                    return
                index, hyps = pair
                hyps = released(hyps)
                if self.nbest is not None:
                    hyps = hyps[:self.nbest]
                best = hyps[0]
                yield Translation(index=index, source=sources.pop(index), text=self.decode(best["tokens"]),
                                  score=float(best["score"]), hypotheses=hyps)
        finally:
            # An error, KeyboardInterrupt or a caller that stops early: the encoder thread (or the
            # workers) stop too. Kept workers that finished the call wait for the next one.
            if kept:
                self._workers_busy = False
                if not completed:
                    self._end_kept_workers(wait=False)
            elif closer is not None:
                closer.close(**({"wait": completed} if on_workers else {}))

    def _finished(self, batches, encoder_queue: int):
        """((index, hypotheses) of the ``batches``' sentences as they finish, the read-ahead to close or None)."""
        def encoded():
            # Runs in the encoder thread with --encoder-queue.
            for net_input, ids in batches:
                yield self.decoder.open(net_input, ids=ids)

        with decoding():  # the encoder thread takes the mode of this thread as it starts
            if isinstance(self.decoder, CohortDecoder):
                cohorts = read_ahead(encoded(), encoder_queue, self.device)
                return self._make_pool().run(cohorts), cohorts
            # A search that decodes whole batches (jacobi): fairseq's generate() per batch.
            return (pair for net_input, ids in batches
                    for pair in zip(ids.tolist(), self.decoder.generate(self.models, {
                        "net_input": net_input, "id": ids}))), None

    def _on_workers(self, batches):
        """``cpu_workers``: each batch streamed by one worker process (schedule/workers.py says why one batch a
        task), in input order; (the pairs as :meth:`_finished` gives them, the workers).

        The workers are forked by the first call and kept for the next ones: forking a loaded model, and
        each worker's first touch of its buffers (40,000 page faults a worker on the Multi30k model), would
        otherwise be paid again by every call. A call that ends early or fails ends them (tasks of its
        may still be in flight), and the next forks new ones; a call made while another still reads from
        them gets workers of its own, ended with it.
        """
        from fairseq_stream.schedule.workers import Workers

        if self._workers_busy:
            workers = Workers(self.layout.workers, self._decode_batch, self.decoder.stats)
        else:
            if self._kept_workers is None:
                self._kept_workers = Workers(self.layout.workers, self._decode_batch, self.decoder.stats)
                # Not a method of self: the finalizer must not keep the Translator alive.
                self._workers_finalizer = weakref.finalize(self, self._kept_workers.close, False)
            workers, self._workers_busy = self._kept_workers, True
        return (pair for pairs in workers.map(batches) for pair in pairs), workers

    def _decode_batch(self, batch) -> list:
        """In a worker: [(index, hypotheses)] of one batch, in input order (no encoder thread: the other
        workers hold the other cores)."""
        finished, _ = self._finished(iter([batch]), 0)
        pairs = []
        while True:
            with decoding():
                pair = next(finished, None)
            if pair is None:
                return sorted(pairs, key=lambda p: p[0])
            pairs.append((pair[0], released(pair[1])))

    def _batches(self, lines, sources):
        """(net_input, ids) batches of the numbered ``lines``; each one's text is kept in ``sources``.

        Maxi-batching (:mod:`fairseq_stream.schedule.maxi_batch`): a window of
        maxi_batch x batch_size sentences, sorted by length, cut into batches;
        maxi_batch 1 is mini-batching, in input order.
        """
        from fairseq_stream.schedule.maxi_batch import windows

        checked = ((index, sentence, self._checked_tokens(index, sentence)) for index, sentence in lines)
        by_length = (lambda item: item[2].numel()) if self.maxi_batch > 1 else None
        for window in windows(checked, self.maxi_batch, self.batch_size, key=by_length):
            for start in range(0, len(window), self.batch_size):
                yield self._encode_batch(window[start:start + self.batch_size], sources)

    def _checked_tokens(self, index: int, sentence: str) -> torch.Tensor:
        ids = self.encode(sentence)
        if ids.numel() > self.max_positions:
            raise FairseqStreamError(
                "input sentence {} has {} tokens, more than the model's {} positions; "
                "shorten or split it".format(index, ids.numel(), self.max_positions))
        return ids

    def _encode_batch(self, chunk, sources):
        tokens, lengths = [], []
        for index, sentence, ids in chunk:
            sources[index] = sentence.rstrip("\n")
            tokens.append(ids)
            lengths.append(ids.numel())
        dataset = self.task.build_dataset_for_inference(tokens, lengths)
        sample = dataset.collater([dataset[i] for i in range(len(tokens))])
        net_input = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in sample["net_input"].items()}
        # The collater sorts by source length; its "id" maps rows back to the chunk. On the host: the decoder
        # keeps a cohort's ids there too, and moves them to the device itself.
        ids = torch.tensor([chunk[i][0] for i in sample["id"].tolist()])
        return net_input, ids


def _checked_paths(paths) -> List[str]:
    """The checkpoint paths as a list of ``str``: one path (``str`` or ``os.PathLike``), an ensemble as
    fairseq's ``--path`` writes it (``"a.pt:b.pt"``), or a sequence of them."""
    if isinstance(paths, str) and os.pathsep in paths and "://" not in paths and not os.path.exists(paths):
        paths = paths.split(os.pathsep)  # fairseq's utils.split_paths: the command line's ensembles
    items = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    if isinstance(items, (bytes, dict)) or not isinstance(items, Iterable):
        raise FairseqStreamError("paths takes a checkpoint file or a list of them, got {!r}".format(paths))
    out = []
    for path in items:
        path = os.fspath(path) if isinstance(path, os.PathLike) else path
        if not isinstance(path, str):
            raise FairseqStreamError("paths takes checkpoint files as str or os.PathLike, got {!r}".format(path))
        if not path:
            raise FairseqStreamError("paths: an empty checkpoint name in {!r}".format(paths))
        out.append(path)
    if not out:
        raise FairseqStreamError("paths takes at least one checkpoint file, got {!r}".format(paths))
    return out


def _typed_arguments(**arguments) -> list:
    """The Translator's own ``arguments``' values, by its signature's types (option_types' rule), in order."""
    from fairseq_stream.option_types import typed

    kinds = typing.get_type_hints(Translator.__init__)
    return [typed(name, value, kinds[name]) for name, value in arguments.items()]


def _typed_options(search: str, options: dict) -> dict:
    """The keyword ``options`` by their fields' types; those the API has no use for and unknown ones refused."""
    from fairseq_stream.option_types import fields, typed

    kinds = fields(search)
    out = {}
    for key, value in options.items():
        if key in COMMAND_LINE_ONLY:
            raise FairseqStreamError("{} has no effect in the Python API: {}".format(key, COMMAND_LINE_ONLY[key]))
        if key not in kinds:
            raise FairseqStreamError("unknown option {!r} for search {}".format(key, search))
        out[key] = typed(key, value, kinds[key])
    return out


def _check_sizes(pool, batch_size, maxi_batch):
    """Refuse a pool, batch or maxi-batch size below 1 (one line each; their types are checked already)."""
    if pool < 1:
        raise FairseqStreamError("pool must be at least 1, got {}".format(pool))
    if batch_size is not None and batch_size < 1:
        raise FairseqStreamError("batch_size must be at least 1, got {}".format(batch_size))
    if maxi_batch < 1:
        raise FairseqStreamError("maxi_batch must be at least 1, got {}".format(maxi_batch))


def _load_models(paths, data, trust_checkpoint, cpu):
    """(models in eval mode on their device, the checkpoint's config, the task, the device)."""
    from fairseq import checkpoint_utils

    from fairseq_stream.checkpoint import trusted_checkpoints

    overrides = {"data": data} if data else {}
    try:
        with trusted_checkpoints(paths if trust_checkpoint else []):
            models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(paths, arg_overrides=overrides)
    except FileNotFoundError as error:
        # The checkpoints are checked before they are read (a one-line error of their own): what is missing
        # now is in the data directory, which fairseq's task reads for the dictionaries (a traceback).
        if error.filename is None or os.fspath(error.filename) in map(os.fspath, paths):
            raise
        raise FairseqStreamError(_data_problem(data, "{} does not exist".format(error.filename))) from None
    except Exception as error:  # fairseq raises a bare Exception for a directory without dict.*.txt files
        if "Could not infer language pair" not in str(error):
            raise
        raise FairseqStreamError(_data_problem(data, "no dict.SRC.txt and dict.TGT.txt in it")) from None
    use_cuda = torch.cuda.is_available() and not cpu
    for m in models:
        m.eval()
        if use_cuda:
            m.cuda()
    return models, cfg, task, torch.device("cuda" if use_cuda else "cpu")


def _data_problem(data, what: str) -> str:
    """The one line for a data directory fairseq's task could not read its dictionaries from."""
    where = "data directory {}".format(data) if data else "the checkpoint's data directory (no data= / --data given)"
    return "{}: {}; give the data-bin directory that holds the model's dictionaries (dict.SRC.txt, " \
           "dict.TGT.txt)".format(where, what)


def _text_codecs(cfg, tokenizer, bpe, sentencepiece_model, bpe_codes):
    """fairseq's tokenizer and BPE: those given, else the checkpoint's (either may be None)."""
    from argparse import Namespace

    from fairseq.data import encoders

    def text_cfg(name, value, **extra):
        if value is None:
            return getattr(cfg, name, None)
        return Namespace(**{name: value}, **{k: v for k, v in extra.items() if v is not None})

    return (encoders.build_tokenizer(text_cfg("tokenizer", tokenizer)),
            encoders.build_bpe(text_cfg("bpe", bpe, sentencepiece_model=sentencepiece_model, bpe_codes=bpe_codes)))


def _first(positions):
    """A model's or task's source positions (fairseq gives (source, target) or one number)."""
    return positions[0] if isinstance(positions, tuple) else positions


def _numbered(items: Iterator):
    """(index, sentence) of each input, checked; a failed read names the sentence it stopped at."""
    index = 0
    while True:
        try:
            sentence = next(items)
        except StopIteration:
            return
        except UnicodeDecodeError as e:
            # A text file decodes in chunks of 8 KB: the bad line is this one or one of the next ~8 KB's.
            bad = _undecodable_line(items, e.encoding)
            if bad is not None:
                raise FairseqStreamError("input sentence {} (line {} of {}) is not valid {}: {}".format(
                    bad, bad + 1, items.name, e.encoding, e.reason)) from None
            raise FairseqStreamError("reading input sentence {} or one soon after it failed (a text file decodes "
                                     "in chunks): {}: {}".format(index, type(e).__name__, e)) from None
        except OSError as e:
            raise FairseqStreamError("reading input sentence {} failed: {}: {}".format(
                index, type(e).__name__, e)) from None
        yield index, check_sentence(index, sentence)
        index += 1


def _undecodable_line(items, encoding: str) -> Optional[int]:
    """The index of the first line of ``items``, a text file read from a file on disk, that does not decode as
    ``encoding``; None where ``items`` is no such file or no line fails when read again."""
    name = getattr(items, "name", None)
    if not isinstance(name, str) or not os.path.isfile(name):
        return None
    index = 0
    try:
        with open(name, "rb") as f:
            for raw in f:
                try:
                    text = raw.decode(encoding)
                except UnicodeDecodeError:
                    return index
                except LookupError:
                    return None
                index += len(text_lines(text))
    except OSError:
        return None
    return None
