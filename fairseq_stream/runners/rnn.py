"""The RNN runner: our own decoder step for fairseq LSTM models, with Devlin (2017)'s tricks.

fairseq's ``LSTMDecoder`` runs, per step, one ``LSTMCell`` per layer on
``[embedding; input feed]`` and the previous hidden state, then its attention
(``input_proj``, a dot product with every encoder state, a masked softmax, the
context, ``tanh(output_proj([context; hidden]))``), then the output layer. This
runner reads the weights once and runs the same step with the paper's
section 4 tricks, each with its own switch (:class:`RnnOptions`):

* **int16** (section 4.1): every weight product in 16-bit fixed point
  (:mod:`fairseq_stream.ops.int16_linear`: weights packed once, rows quantized
  per call, int32 sums). The only trick that changes results (see below).
* **embed table** (4.2): the first layer's input product ``W_e x + b`` for the
  ``embed_table_words`` most frequent target words (fairseq dictionaries are
  sorted by frequency) is a table looked up per token; rarer words are
  multiplied as before.
* **attention table** (4.3): the source-only halves of the attention are
  computed once per sentence: ``K = S W_in`` (so a score is ``K_j . h``) and
  ``V = S W_c^T`` (so ``W_c c = sum_j a_j V_j``); per row only ``W_h h`` of the
  output projection is left.
* **merge states** (4.5): children of one hypothesis share its recurrent
  state; the recurrent products (``W_hh h``, and the first layer's ``W_f``
  times its input feed) are computed once per parent, not once per row. A
  reorder only records each row's parent.
* **int16 output**: with int16, the output layer too (logits go to the fused
  top-k when ``--output-layer`` picks it).
* **fused step** (with int16; section 4.4's vectorized nonlinearities): the
  whole step in one compiled call (:mod:`fairseq_stream.ops.rnn_step`): the
  int16 products, and the cells, the attention and its output in vectorized
  loops with approximate exp and tanh, instead of about 35 torch ops. It
  needs the attention table (or a model without attention); otherwise, or
  without the compiled extension, the torch step runs.

Without the fused step, sigmoid and tanh are torch's own vectorized CPU
kernels; lookup tables would change results more and are not used.

Exactness: every trick except int16 is an identity of the arithmetic, so in
float64 the n-best lists equal the fairseq runner's (tests/test_rnn_runner.py;
fairseq rounds attention scores to float32 even in a float64 model, which
bounds the agreement at ~1e-7 where the attention table reorders that sum).
int16 products differ from float ones by the bound in
:mod:`~fairseq_stream.ops.int16_linear`, and the fused step from the torch
int16 step by float rounding (:mod:`fairseq_stream.ops.rnn_step`);
benchmarks/bench_int16.py measures how many translations that changes.
"""

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from fairseq.dataclass import FairseqDataclass

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import int16_linear as int16
from fairseq_stream.ops import product
from fairseq_stream.ops import rnn_step as compiled_step
from fairseq_stream.runners.own_step import OwnStepRunner
from fairseq_stream.ops.packing import pack_by_sentence
from fairseq_stream.option_field import option

# The first layer's input table holds this many of the most frequent words by default.
DEFAULT_EMBED_TABLE_WORDS = 50000
# Up to this many parents the int16 kernel multiplies them all in one pass of the weights (its
# micro-kernels hold 6 rows on AVX2, 12 on AVX-512), so finding the distinct ones (torch.unique,
# ~20 us) cannot pay: measured one sentence at a time at beam 5 on the AVX2 machine, merging every
# step was 14% slower than not merging.
MERGE_ABOVE_PARENTS = 6


@dataclass
class RnnOptions:
    """Which of Devlin's tricks the RNN runner uses (all on by default, int16 off)."""

    int16: bool = False
    embed_table: bool = True
    embed_table_words: int = DEFAULT_EMBED_TABLE_WORDS
    attention_table: bool = True
    merge_states: bool = True
    int16_output: bool = True
    fused_step: bool = True

    def describe(self) -> str:
        """The tricks in use, for the log line."""
        used = ["int16 products" + ("" if self.int16_output else " (output layer in float)")] if self.int16 else []
        if self.embed_table:
            used.append("embedding table")
        if self.attention_table:
            used.append("attention table")
        if self.merge_states:
            used.append("merged states")
        if self.int16 and self.fused_step:
            used.append("fused step")
        return ", ".join(used) or "no tricks"


    @classmethod
    def from_config(cls, cfg) -> "RnnOptions":
        """The tricks of the ``--rnn-*`` options (:class:`RnnRunnerConfig`, or the API's options of those names)."""
        words = int(getattr(cfg, "rnn_embed_table_words", DEFAULT_EMBED_TABLE_WORDS))
        if words < 0:
            raise FairseqStreamError("--rnn-embed-table-words must be 0 (all) or more, got {}".format(words))
        return cls(
            int16=bool(getattr(cfg, "rnn_int16", False)),
            embed_table=not getattr(cfg, "no_rnn_embed_table", False),
            embed_table_words=words,
            attention_table=not getattr(cfg, "no_rnn_attention_table", False),
            merge_states=not getattr(cfg, "no_rnn_merge_states", False),
            int16_output=not getattr(cfg, "no_rnn_int16_output", False),
            fused_step=not getattr(cfg, "no_rnn_fused_step", False),
        )


@dataclass
class RnnRunnerConfig(FairseqDataclass):
    """The rnn runner's ``--rnn-*`` options; every search's options include them (any search runs on it)."""

    rnn_int16: bool = option(False, "LSTM models on the CPU: 16-bit fixed-point products (Devlin 2017) on the rnn "
                             "runner, with every --no-rnn-* trick on unless turned off")
    no_rnn_embed_table: bool = option(False, "rnn runner: multiply the first LSTM layer's input per token instead of "
                                      "looking it up in a table of the most frequent words")
    rnn_embed_table_words: int = option(DEFAULT_EMBED_TABLE_WORDS, "rnn runner: words in the first layer's input "
                                        "table (the most frequent; 0: all)")
    no_rnn_attention_table: bool = option(False, "rnn runner: do not pre-compute the attention's source-side products "
                                          "per sentence")
    no_rnn_merge_states: bool = option(False, "rnn runner: compute recurrent products per row instead of once per "
                                       "parent hypothesis")
    no_rnn_int16_output: bool = option(False, "with --rnn-int16: keep the output layer in float32")
    no_rnn_fused_step: bool = option(False, "with --rnn-int16: run the decoder step as torch operations instead of "
                                     "one compiled call (vectorized approximate sigmoid and tanh)")


def unsupported_reason(model) -> Optional[str]:
    """Why the RNN runner cannot run ``model`` (None if it can)."""
    from fairseq.models.lstm import LSTMDecoder, LSTMEncoder

    name = type(model).__name__
    decoder = getattr(model, "decoder", None)
    if not isinstance(decoder, LSTMDecoder):
        return "{} is not a fairseq LSTM model".format(name)
    if not isinstance(getattr(model, "encoder", None), LSTMEncoder):
        return "{} has no fairseq LSTM encoder".format(name)
    for method in ("extract_features", "forward", "output_layer"):
        if getattr(type(decoder), method) is not getattr(LSTMDecoder, method):
            return "{}'s decoder has its own {}".format(name, method)
    if decoder.adaptive_softmax is not None:
        return "{} has an adaptive softmax".format(name)
    if decoder.encoder_output_units == 0:
        return "{} has a decoder without an encoder".format(name)
    for cell in decoder.layers:
        if not isinstance(cell, torch.nn.LSTMCell) or cell.bias_ih is None:
            return "{} has an LSTM cell of an unknown kind".format(name)
    return None


class _Product:
    """``x W^T + b`` in float (torch) or in 16-bit fixed point (a packed weight): the one product op's int16
    precision (:func:`fairseq_stream.ops.product.of_int16`), the object the compiled step takes too; int16's
    torch reference where the kernels are not built."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], use_int16: bool):
        self.weight, self.bias = weight, bias
        self.packed = int16.pack(weight, bias) if use_int16 else None
        self.int16 = product.of_int16(self.packed) if self.packed is not None and int16.kernels() else None

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.int16 is None:
            return int16.reference(x, self.packed).to(x.dtype)
        return self.int16(x.float()).to(x.dtype)

    def compiled(self):
        """The same product for :func:`fairseq_stream.ops.rnn_step.rnn_step`."""
        if self.packed is not None:
            return compiled_step.product(self.int16)
        return compiled_step.product(weight=self.weight, bias=self.bias)


def _bias(cell) -> Tensor:
    return cell.bias_ih + cell.bias_hh


class RnnModel:
    """One fairseq LSTM model's decoder weights, arranged for the step."""

    def __init__(self, model, options: RnnOptions):
        decoder = model.decoder
        self.model = model
        self.options = options
        q = options.int16
        self.embed = decoder.embed_tokens.weight
        self.hidden = decoder.hidden_size
        self.layers = decoder.num_layers
        self.residuals = decoder.residuals
        embed_dim = self.embed.size(1)
        first = decoder.layers[0]
        # The first cell's input is [embedding; input feed].
        w_embed, w_feed = first.weight_ih[:, :embed_dim], first.weight_ih[:, embed_dim:]
        self.input_product = _Product(w_embed, _bias(first), q)
        self.table = None
        if options.embed_table:
            words = len(self.embed)
            if options.embed_table_words:
                words = min(words, int(options.embed_table_words))
            self.table = F.linear(self.embed[:words], w_embed, _bias(first))
        # Recurrent products: the first layer's on [input feed; h], the others' on h.
        self.recurrent = [_Product(torch.cat([w_feed, first.weight_hh], dim=1), None, q)]
        self.recurrent += [_Product(cell.weight_hh, None, q) for cell in decoder.layers[1:]]
        self.upper_input = [_Product(cell.weight_ih, _bias(cell), q) for cell in decoder.layers[1:]]
        self.hidden_proj = decoder.encoder_hidden_proj
        self.cell_proj = decoder.encoder_cell_proj
        attention = decoder.attention
        self.attention = attention is not None
        if self.attention:
            self.w_in = attention.input_proj.weight  # (source dim, hidden), no bias
            w_out = attention.output_proj.weight  # (hidden, source dim + hidden): [context; hidden]
            source_dim = self.w_in.size(0)
            self.w_context = w_out[:, :source_dim]
            # Only the products :meth:`attend` runs: with the table, the hidden half of the output
            # projection; without it, the query projection and the whole output projection.
            if options.attention_table:
                self.out_hidden = _Product(w_out[:, source_dim:], None, q)
            else:
                self.out_full = _Product(w_out, None, q)
                self.in_product = _Product(self.w_in, None, q)
        extra = getattr(decoder, "additional_fc", None)
        self.additional_fc = _Product(extra.weight, extra.bias, q) if extra is not None else None
        if decoder.share_input_output_embed:
            out_weight, out_bias = self.embed, None
        else:
            out_weight, out_bias = decoder.fc_out.weight, decoder.fc_out.bias
        self.output = _Product(out_weight, out_bias, q and options.int16_output)
        self.fused = self._fused_products() if self.fuses_step() else None

    def fuses_step(self) -> bool:
        """Whether this model's steps run as one compiled call (:mod:`fairseq_stream.ops.rnn_step`)."""
        o = self.options
        return (o.int16 and o.fused_step and compiled_step.available()
                and (not self.attention or o.attention_table))

    def _fused_products(self):
        def each(products):
            return [p.compiled() for p in products]

        return dict(
            recurrent=each(self.recurrent), upper_input=each(self.upper_input),
            out_hidden=self.out_hidden.compiled() if self.attention else None,
            additional_fc=self.additional_fc.compiled() if self.additional_fc is not None else None,
            output=self.output.compiled(),
        )

    def encode(self, net_input):
        """fairseq's encoder; then the per-sentence tensors and the initial state (one parent per sentence)."""
        enc_out, hiddens, cells, padding = self.model.encoder(net_input["src_tokens"], net_input["src_lengths"])
        states = enc_out.transpose(0, 1).contiguous()  # (S, T, C)
        mask = padding.t().contiguous()  # (S, T) True at padding
        source = _Source(states, mask, None, None)
        if self.attention and self.options.attention_table:
            source = _Source(None, mask, torch.matmul(states, self.w_in), torch.matmul(states, self.w_context.t()))
        h = [hiddens[i] for i in range(self.layers)]
        c = [cells[i] for i in range(self.layers)]
        if self.hidden_proj is not None:
            h = [self.hidden_proj(x) for x in h]
            c = [self.cell_proj(x) for x in c]
        feed = states.new_zeros(states.size(0), self.hidden)
        return source, _Recurrent(torch.stack(h), torch.stack(c), feed)

    def input_part(self, tokens: Tensor) -> Tensor:
        """``W_e x + b`` of the first cell for each token: from the table where it has the word."""
        if self.table is None:
            return self.input_product(F.embedding(tokens, self.embed))
        words = self.table.size(0)
        if words == self.embed.size(0):
            return self.table.index_select(0, tokens)
        part = self.table.index_select(0, tokens.clamp(max=words - 1))
        rare = (tokens >= words).nonzero().flatten()
        if rare.numel():
            part[rare] = self.input_product(F.embedding(tokens.index_select(0, rare), self.embed))
        return part

    def attend(self, hidden: Tensor, source: "_Source", packing) -> Tensor:
        """The attention layer's output for each row.

        ``packing``: (each row's index in a (sentences, width) layout, width)
        from :func:`pack_by_sentence`, or None when all rows are of one sentence.
        """
        S = source.sentences
        if source.keys is not None:
            query, keys, values = hidden, source.keys, source.values
        else:
            query, keys, values = self.in_product(hidden), source.states, source.states
        if packing is None:
            packed, width = query, query.size(0)
        else:
            where, width = packing
            packed = query.new_zeros(S * width, query.size(1))
            packed[where] = query
        scores = torch.bmm(packed.view(S, width, -1), keys.transpose(1, 2))  # (S, width, T)
        # fairseq masks (and so rounds) attention scores in float32 whatever the model's type.
        scores = scores.float().masked_fill_(source.mask.unsqueeze(1), float("-inf")).to(hidden.dtype)
        weights = torch.softmax(scores, dim=-1)
        mixed = torch.bmm(weights, values).view(S * width, -1)
        if packing is not None:
            mixed = mixed[where]
        if source.keys is not None:
            return torch.tanh(mixed + self.out_hidden(hidden))
        return torch.tanh(self.out_full(torch.cat([mixed, hidden], dim=1)))

    def logits(self, out: Tensor) -> Tensor:
        if self.additional_fc is not None:
            out = self.additional_fc(out)
        return self.output(out)


@dataclass
class _Source:
    """One model's per-sentence tensors: encoder states, or the attention tables, and the padding mask."""

    states: Optional[Tensor]  # (S, T, C) without the attention table
    mask: Tensor  # (S, T) bool, True at padding
    keys: Optional[Tensor] = None  # (S, T, hidden) = states @ W_in
    values: Optional[Tensor] = None  # (S, T, hidden) = states @ W_context^T

    @property
    def sentences(self) -> int:
        return self.mask.size(0)

    def tensors(self):
        return [t for t in (self.states, self.keys, self.values) if t is not None]

    def select(self, sentences: Tensor) -> "_Source":
        pick = (lambda t: t.index_select(0, sentences) if t is not None else None)
        return _Source(pick(self.states), pick(self.mask), pick(self.keys), pick(self.values))

    @staticmethod
    def concat(parts: List["_Source"]) -> "_Source":
        """Join along sentences; shorter sources are padded on the right and masked."""
        length = max(p.mask.size(1) for p in parts)

        def join(name, value):
            tensors = [getattr(p, name) for p in parts]
            if tensors[0] is None:
                return None
            padded = []
            for t in tensors:
                extra = length - t.size(1)
                if extra:
                    t = torch.cat([t, t.new_full((t.size(0), extra) + t.shape[2:], value)], dim=1)
                padded.append(t)
            return torch.cat(padded)

        return _Source(join("states", 0.0), join("mask", True), join("keys", 0.0), join("values", 0.0))


@dataclass
class _Recurrent:
    """One model's recurrent state of a group of parents: ``(layers, parents, hidden)`` h and c, and the feed."""

    h: Tensor
    c: Tensor
    feed: Tensor  # (parents, hidden): the last attention output

    @property
    def parents(self) -> int:
        return self.feed.size(0)

    def select(self, index: Tensor) -> "_Recurrent":
        return _Recurrent(self.h.index_select(1, index), self.c.index_select(1, index),
                          self.feed.index_select(0, index))

    @staticmethod
    def concat(parts: List["_Recurrent"]) -> "_Recurrent":
        return _Recurrent(torch.cat([p.h for p in parts], 1), torch.cat([p.c for p in parts], 1),
                          torch.cat([p.feed for p in parts]))


@dataclass
class RnnState:
    """The RNN runner's state of a group of rows.

    Each row continues a *parent* (``parent[i]``; None: row i is parent i)
    whose recurrent state is in ``recurrent`` (one per model). Tensors are
    replaced, never written, so states taken from one another share them.
    """

    sources: List[_Source]
    row_sentence: Tensor  # (rows,) index into the sources' sentences
    recurrent: List[_Recurrent]
    parent: Optional[Tensor] = field(default=None)
    pack: Optional[tuple] = field(default=None)  # pack_by_sentence of row_sentence, made when needed

    @property
    def rows(self) -> int:
        return self.row_sentence.numel()

    def packing(self):
        """Each row's place in a (sentences, width) layout, or None for rows of one sentence."""
        if self.sources[0].sentences == 1:
            return None
        if self.pack is None:
            self.pack = pack_by_sentence(self.row_sentence, self.sources[0].sentences)
        return self.pack

    def parents(self) -> Tensor:
        if self.parent is None:
            return torch.arange(self.rows, device=self.row_sentence.device)
        return self.parent


class RnnRunner(OwnStepRunner):
    """Encode sentences, then run single-token decoder steps of fairseq LSTM models ourselves.

    The same interface as :class:`fairseq_stream.runners.fairseq_runner.ModelRunner`.

    Args:
        models, temperature: as :class:`~fairseq_stream.runners.own_step.OwnStepRunner`'s (LSTM models,
            as :func:`unsupported_reason` accepts them).
        options: the tricks to use.
    """

    name = "rnn"
    # An LSTM's state does not depend on the prefix length: cohorts at different steps join (Cohort.merge).
    joins_lengths = True

    def __init__(self, models, temperature: float = 1.0, options: Optional[RnnOptions] = None):
        super().__init__(models, temperature)
        self.options = options or RnnOptions()
        if self.options.int16 and self.dtype != torch.float32:
            raise FairseqStreamError("--rnn-int16 needs a float32 model (this one is {})".format(self.dtype))
        self._build()

    @torch.no_grad()
    def _build(self):
        self.rnn = [RnnModel(m, self.options) for m in self.model.models]

    def cuda(self):
        if self.options.int16:
            raise FairseqStreamError("--rnn-int16 runs on the CPU only (its kernels are CPU kernels); drop --rnn-int16 "
                                     "or decode with --cpu")
        return super().cuda()

    # -- the interface -----------------------------------------------------

    @torch.no_grad()
    def start(self, net_input, rows_per_sentence: int, sentence_ids: Optional[Tensor] = None) -> RnnState:
        """Encode ``net_input``; ``rows_per_sentence`` decoder rows per sentence, nothing decoded yet."""
        encoded = [m.encode(net_input) for m in self.rnn]
        S = net_input["src_tokens"].size(0)
        row_sentence = torch.arange(S, device=net_input["src_tokens"].device).repeat_interleave(rows_per_sentence)
        # Each sentence's initial state is the parent of its rows.
        state = RnnState([e[0] for e in encoded], row_sentence, [e[1] for e in encoded], row_sentence.clone())
        if not self.options.merge_states:
            self._materialize(state)
        return state

    @torch.no_grad()
    def step(self, state: RnnState, tokens: Tensor, logits: bool = False):
        """:class:`~fairseq_stream.runners.base.Runner`'s ``step``, on the prefixes' last tokens (an LSTM keeps
        the rest in its state); the attention returned is None (none is kept)."""
        return self._forward([state], tokens[:, -1], logits), None

    @torch.no_grad()
    def step_mixed(self, states: List[RnnState], last_tokens: Tensor, lengths: List[int], logits: bool = False):
        """One decoder call over groups whose prefixes differ in length: an LSTM step does not depend on it."""
        return self.step_own(states, last_tokens, logits)

    @torch.no_grad()
    def step_own(self, states: List[RnnState], last_tokens: Tensor, logits: bool = False):
        """One decoder call over ``states`` of any lengths; ``last_tokens`` (rows, 1), states in order."""
        return self._forward(states, last_tokens.view(-1), logits), None

    def reorder(self, state: RnnState, new_order: Tensor):
        """Make row ``i`` continue old row ``new_order[i]`` (select, copy or drop rows), in place."""
        state.parent = state.parents().index_select(0, new_order)
        new_sentence = state.row_sentence.index_select(0, new_order)
        if not torch.equal(new_sentence, state.row_sentence):
            state.row_sentence = new_sentence
            state.pack = None
            self._compact(state)
        if not self.options.merge_states:
            self._materialize(state)

    def take(self, state: RnnState, rows: Tensor) -> RnnState:
        """A new state holding rows ``rows`` of ``state``; ``state`` itself is left as it was."""
        taken = RnnState(state.sources, state.row_sentence, state.recurrent, state.parent)
        self.reorder(taken, rows)
        return taken

    def concat(self, states: List[RnnState], any_length: bool = False) -> RnnState:
        """One state holding the rows of ``states`` in order (at any lengths: an LSTM's state has none)."""
        if len(states) == 1:
            return states[0]
        return self._joined(states)

    # -- internals ---------------------------------------------------------

    @staticmethod
    def _materialize(state: RnnState):
        """Give every row its own copy of its parent's state (no merged states)."""
        if state.parent is not None:
            state.recurrent = [r.select(state.parent) for r in state.recurrent]
            state.parent = None

    @staticmethod
    def _compact(state: RnnState):
        """Drop per-sentence tensors of sentences that have no row left."""
        sentences = state.sources[0].sentences
        present = torch.zeros(sentences, dtype=torch.bool, device=state.row_sentence.device)
        present[state.row_sentence] = True
        kept = present.nonzero().flatten()
        if kept.numel() < sentences:
            state.sources = [s.select(kept) for s in state.sources]
            state.row_sentence = (torch.cumsum(present, 0) - 1)[state.row_sentence]

    @staticmethod
    def _joined_parents(states: List[RnnState]):
        """The parents of ``states`` joined (an index per row, None for rows that are their own) and their states."""
        parents, at = [], 0
        for s in states:
            parents.append(s.parents() + at)
            at += s.recurrent[0].parents
        parent = None if all(s.parent is None for s in states) else torch.cat(parents)
        models = range(len(states[0].recurrent))
        return parent, [_Recurrent.concat([s.recurrent[i] for s in states]) for i in models]

    @classmethod
    def _joined(cls, states: List[RnnState]) -> RnnState:
        """One state with the rows, parents and sentences of ``states`` in order (nothing copied per row)."""
        sentences, at = [], 0
        for s in states:
            sentences.append(s.row_sentence + at)
            at += s.sources[0].sentences
        parent, recurrent = cls._joined_parents(states)
        models = range(len(states[0].sources))
        return RnnState([_Source.concat([s.sources[i] for s in states]) for i in models], torch.cat(sentences),
                        recurrent, parent)

    def _forward(self, states: List[RnnState], last_tokens: Tensor, logits: bool = False):
        """One step of every model over the states' rows; the ensemble's log-probabilities (or logits)."""
        if len(states) == 1:
            parent, recurrent = states[0].parent, states[0].recurrent
        else:
            parent, recurrent = self._joined_parents(states)
        if parent is not None and recurrent[0].parents > MERGE_ABOVE_PARENTS:
            # Section 4.5: the recurrent products of the distinct parents only.
            used, parent = torch.unique(parent, return_inverse=True)
            if used.numel() < recurrent[0].parents:
                recurrent = [r.select(used) for r in recurrent]
        bounds, at = [], 0
        for s in states:
            bounds.append((at, at + s.rows))
            at += s.rows
        outs, new = [], []
        for i, model in enumerate(self.rnn):
            if model.fused is not None:
                out, state = self._fused_model_step(model, recurrent[i], parent, last_tokens,
                                                    [(s.sources[i], s.row_sentence) for s in states])
            else:
                out, state = self._model_step(model, recurrent[i], parent, last_tokens,
                                              [(s.sources[i], s.packing()) for s in states], bounds)
            outs.append(out)
            new.append(state)
        for s, (a, b) in zip(states, bounds):
            s.recurrent = [_Recurrent(r.h[:, a:b], r.c[:, a:b], r.feed[a:b]) for r in new]
            s.parent = None
        return self._ensemble(outs, logits)

    @staticmethod
    def _fused_model_step(model: RnnModel, rec: _Recurrent, parent: Optional[Tensor], tokens: Tensor, groups):
        """:meth:`_model_step` as one compiled call; ``groups``: (source, row_sentence) per state."""
        f = model.fused
        attention = [[], [], [], []]
        if model.attention:
            attention = [[src.keys for src, _ in groups], [src.values for src, _ in groups],
                         [src.mask for src, _ in groups], [rows for _, rows in groups]]
        logits, h, c, out = compiled_step.rnn_step(
            model.input_part(tokens), rec.feed, rec.h, rec.c, parent, f["recurrent"], f["upper_input"],
            model.residuals, *attention, f["out_hidden"], f["additional_fc"], f["output"])
        return logits, _Recurrent(h, c, out)

    def _model_step(self, model: RnnModel, rec: _Recurrent, parent: Optional[Tensor], tokens: Tensor,
                    sources, bounds):
        """One model's step: its logits and the rows' new recurrent state."""

        def per_row(t: Tensor) -> Tensor:
            return t if parent is None else t.index_select(0, parent)

        x = model.input_part(tokens)
        hs, cs = [], []
        for layer in range(model.layers):
            h_prev = rec.h[layer]
            if layer == 0:
                recurrent = model.recurrent[0](torch.cat([rec.feed, h_prev], dim=1))
            else:
                recurrent = model.recurrent[layer](h_prev)
                x = model.upper_input[layer - 1](x)
            gates = x + per_row(recurrent)
            i, f, g, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * per_row(rec.c[layer]) + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            hs.append(h)
            cs.append(c)
            x = h + per_row(h_prev) if model.residuals else h
        hidden = hs[-1]
        if model.attention:
            parts = [model.attend(hidden[a:b], source, packing)
                     for (source, packing), (a, b) in zip(sources, bounds)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            out = hidden
        return model.logits(out), _Recurrent(torch.stack(hs), torch.stack(cs), out)


