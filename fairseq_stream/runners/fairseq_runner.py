"""The model runner: encoder and decoder calls on fairseq's ``EnsembleModel``.

It runs single-token decoder steps over a :class:`RowState` (the encoder
outputs and incremental decoder states of a group of rows) and moves that
state when rows are selected, duplicated, dropped or joined with another
group. It knows nothing about why rows are chosen (that is the search's and
the scheduler's business).

We gather every incremental buffer ourselves: fairseq's
``MultiheadAttention.reorder_incremental_state`` skips the encoder-attention
buffers whenever the new order has as many rows as the old one, which is only
right when rows never move across sentences.
"""

import contextlib
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor
from fairseq.models import FairseqIncrementalDecoder
from fairseq.models.fairseq_decoder import FairseqDecoder
from fairseq.models.fairseq_model import BaseFairseqModel
from fairseq.models.transformer.transformer_base import TransformerModelBase
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.sequence_generator import EnsembleModel

from fairseq_stream import state_merge
from fairseq_stream.runners.base import module_dtype

# Model-level get_normalized_probs that only hand the output to the decoder's.
_PLAIN_MODEL_NORMALIZERS = (BaseFairseqModel.get_normalized_probs, TransformerModelBase.get_normalized_probs)


@dataclass
class RowState:
    """What the decoder needs to continue a group of rows, one entry per model."""

    encoder_outs: list
    row_sentence: Tensor  # (rows,) sentence id of each row
    incremental_states: List[dict]

    @property
    def rows(self) -> int:
        return self.row_sentence.numel()


class ModelRunner:
    """Encode sentences, then run single-token decoder steps over changing groups of rows.

    Args:
        models: a list of fairseq models (an ensemble of one or more) or an
            ``EnsembleModel``.
        temperature: divides the decoder logits, as fairseq's ``--temperature``.
    """

    def __init__(self, models, temperature: float = 1.0):
        self.model = models if isinstance(models, EnsembleModel) else EnsembleModel(models)
        self.model.eval()
        self.temperature = temperature
        self._attention = [
            [m for m in model.decoder.modules() if isinstance(m, MultiheadAttention)]
            for model in self.model.models
        ]
        self._owners = None

    name = "fairseq"
    # fairseq's incremental states hold one length per group: cohorts at different steps stay apart
    # (one call over them pads, step_mixed).
    joins_lengths = False

    def max_decoder_positions(self):
        return self.model.max_decoder_positions()

    @property
    def dtype(self) -> torch.dtype:
        """The models' floating-point type."""
        return module_dtype(self.model)

    def cuda(self):
        self.model.cuda()
        return self

    @torch.no_grad()
    def start(self, net_input, rows_per_sentence: int, sentence_ids: Optional[Tensor] = None) -> RowState:
        """Encode ``net_input``; ``rows_per_sentence`` decoder rows per sentence, nothing decoded yet."""
        # Keep every attention buffer per row (no "beamable" sharing of encoder
        # keys across a sentence's rows), so that rows can move freely.
        self.model.set_decoder_beam_size(1)
        encoder_outs = self.model.forward_encoder(net_input)
        src_tokens = net_input["src_tokens"]
        bsz = src_tokens.size(0)
        if sentence_ids is None:
            sentence_ids = torch.arange(bsz, device=src_tokens.device)
        order = torch.arange(bsz, device=src_tokens.device).repeat_interleave(rows_per_sentence)
        return RowState(
            encoder_outs=self.model.reorder_encoder_out(encoder_outs, order),
            row_sentence=sentence_ids.to(src_tokens.device).index_select(0, order),
            incremental_states=[{} for _ in self.model.models],
        )

    def logits_unsupported(self) -> Optional[str]:
        """Why :meth:`step` cannot return logits for these models (None: it can).

        Logits stand for the log-probabilities only where a model normalizes
        them with fairseq's plain log-softmax; an adaptive softmax or a model
        with its own normalization needs fairseq's ``get_normalized_probs``.
        """
        for model in self.model.models:
            decoder = getattr(model, "decoder", None)
            if decoder is None:
                return "{} has no decoder".format(type(model).__name__)
            if getattr(decoder, "adaptive_softmax", None) is not None:
                return "{} uses an adaptive softmax".format(type(decoder).__name__)
            if getattr(decoder, "onnx_trace", False):
                return "{} is traced for ONNX".format(type(decoder).__name__)
            plain = (
                type(model).get_normalized_probs in _PLAIN_MODEL_NORMALIZERS
                and type(model).get_normalized_probs_scriptable is BaseFairseqModel.get_normalized_probs_scriptable
                and type(decoder).get_normalized_probs is FairseqDecoder.get_normalized_probs
                and type(decoder).get_normalized_probs_scriptable
                is FairseqDecoder.get_normalized_probs_scriptable
            )
            if not plain:
                return "{} normalizes its output its own way".format(type(model).__name__)
        return None

    @torch.no_grad()
    def step(self, state: RowState, tokens: Tensor, logits: bool = False):
        """Run one decoder step on all rows of ``state``.

        Args:
            tokens: (rows, length) target prefixes, all of the same length
                (fairseq gives every row the position ``padding_idx + length``).
            logits: return each model's logits instead of the ensemble's
                log-probabilities (see :meth:`logits_unsupported`).

        Returns:
            (lprobs (rows, vocab), attention (rows, src_len) or None); with
            ``logits``, (a list of one (rows, vocab) tensor per model, in the
            model's type, before ``--temperature``, None).
        """
        return self._decode(tokens, state.encoder_outs, state.incremental_states, logits)

    def _decode(self, tokens, encoder_outs, incremental_states, logits: bool):
        if not logits:
            return self.model.forward_decoder(tokens, encoder_outs, incremental_states, self.temperature)
        # EnsembleModel.forward_decoder up to get_normalized_probs, which the
        # fused output layer replaces.
        outs = []
        incremental = self.model.has_incremental_states()
        for i, model in enumerate(self.model.models):
            encoder_out = encoder_outs[i] if self.model.has_encoder() else None
            if incremental:
                out = model.decoder.forward(tokens, encoder_out=encoder_out, incremental_state=incremental_states[i])
            else:
                out = model.decoder.forward(tokens, encoder_out=encoder_out)
            outs.append(out[0][:, -1, :])
        return outs, None

    def reorder(self, state: RowState, new_order: Tensor):
        """Make row ``i`` continue old row ``new_order[i]`` (select, copy or drop rows), in place."""
        # Encoder outputs and encoder-attention keys depend only on a row's
        # sentence: when every row keeps the sentence it had, they stay as
        # they are (most steps of fixed-width search), else they are gathered.
        new_row_sentence = state.row_sentence.index_select(0, new_order)
        same_sentences = torch.equal(new_row_sentence, state.row_sentence)
        state.row_sentence = new_row_sentence
        if not same_sentences:
            state.encoder_outs = self.model.reorder_encoder_out(state.encoder_outs, new_order)
        for model, inc_state, attentions in zip(
            self.model.models, state.incremental_states, self._attention
        ):
            for attention in attentions:
                buffer = attention._get_input_buffer(inc_state)
                if not buffer or (same_sentences and attention.encoder_decoder_attention):
                    continue
                for key, value in buffer.items():
                    if value is not None:
                        buffer[key] = value.index_select(0, new_order)
                attention._set_input_buffer(inc_state, buffer)
            # Decoders that cache state outside attention modules (the LSTM's
            # hidden and cell states) reorder it themselves; theirs is a plain
            # index_select on every tensor, safe across sentences.
            decoder = model.decoder
            own = type(decoder).reorder_incremental_state
            if own is not FairseqIncrementalDecoder.reorder_incremental_state and inc_state:
                own(decoder, inc_state, new_order)

    def take(self, state: RowState, rows: Tensor) -> RowState:
        """A new state holding rows ``rows`` of ``state``; ``state`` itself is left as it was."""
        # Copy the buffer dicts: reorder replaces tensors in them, and the
        # caller (a cohort split in two) still needs the originals.
        taken = RowState(
            state.encoder_outs, state.row_sentence,
            [{key: dict(buf) for key, buf in s.items()} for s in state.incremental_states],
        )
        self.reorder(taken, rows)
        return taken

    @torch.no_grad()
    def step_mixed(self, states: List[RowState], last_tokens: Tensor, lengths: List[int], logits: bool = False):
        """One decoder call over groups whose prefixes differ in length (VAR-STR-FIFO).

        Every row attends over the longest prefix's positions, its own padded
        and masked, and gets its own position embedding. Afterwards each group
        keeps its own state plus this step.

        Args:
            states: one per group, each already past its first step.
            last_tokens: (rows, 1) the last token of every row, groups in order.
            lengths: the prefix length of each group.
            logits: as :meth:`step`.

        Returns:
            as :meth:`step`, rows in group order.
        """
        rows = [s.rows for s in states]
        encoder_outs, joint_states = self._join(states, mixed_lengths=True)
        row_lengths = torch.cat([
            torch.full((n,), length, dtype=torch.long, device=last_tokens.device)
            for n, length in zip(rows, lengths)
        ])
        with _row_positions(self.model.models, row_lengths):
            out = self._decode(last_tokens, encoder_outs, joint_states, logits)
        for i in range(len(self.model.models)):
            state_merge.take_new_step(self._owners[i], joint_states[i],
                                      [s.incremental_states[i] for s in states], rows)
        return out

    def _join(self, states: List[RowState], mixed_lengths: bool = False):
        """Every model's encoder outputs and incremental states of ``states``, concatenated."""
        if self._owners is None:
            self._owners = [state_merge.state_owners(m.decoder) for m in self.model.models]
        rows = [s.rows for s in states]
        encoder_outs, incremental_states = [], []
        for i in range(len(self.model.models)):
            parts = [s.encoder_outs[i] for s in states]
            length = max(state_merge.source_length(p) for p in parts)
            encoder_outs.append(state_merge.concat_encoder_outs(parts, length))
            inc = [s.incremental_states[i] for s in states]
            incremental_states.append(
                state_merge.concat_incremental_states(self._owners[i], inc, rows, length, mixed_lengths)
                if inc[0] else {}
            )
        return encoder_outs, incremental_states

    def concat(self, states: List[RowState], any_length: bool = False) -> RowState:
        """One state holding the rows of ``states`` in order; all must be at the same length.

        ``any_length`` (states at different lengths, :meth:`Cohort.merge`) is
        refused: fairseq's incremental state has one length (``joins_lengths``).
        """
        if any_length:
            raise ValueError("internal: the fairseq runner joins states of one length only")
        if len(states) == 1:
            return states[0]
        for i in range(len(self.model.models)):
            started = [bool(s.incremental_states[i]) for s in states]
            if any(started) and not all(started):
                raise ValueError("joining decoder states of different steps")
        encoder_outs, incremental_states = self._join(states)
        return RowState(
            encoder_outs=encoder_outs,
            row_sentence=torch.cat([s.row_sentence for s in states]),
            incremental_states=incremental_states,
        )

    def step_own(self, states: List[RowState], last_tokens: Tensor, logits: bool = False):
        """Refused: no state holds rows at different lengths here (``joins_lengths``; :meth:`concat`)."""
        raise ValueError("internal: the fairseq runner steps groups of one length only (step, step_mixed)")

    @staticmethod
    def release_float_weights() -> int:
        """0: fairseq's models keep their float products."""
        return 0


@contextlib.contextmanager
def _row_positions(models, row_lengths: Tensor):
    """Give row ``i`` the position of a prefix of ``row_lengths[i]`` tokens in the decoders.

    In incremental decoding fairseq embeds one position (``padding_idx +
    prefix length``) for every row; a forward hook replaces that with one per
    row, looked up in the same table, so each row gets exactly the embedding
    it would get in a call of its own.
    """
    handles = []
    for model in models:
        module = getattr(model.decoder, "embed_positions", None)
        if module is None:
            continue

        def hook(mod, args, output):
            index = mod.padding_idx + row_lengths
            table = mod.weight if hasattr(mod, "weight") and not hasattr(mod, "weights") else mod.weights
            return table.index_select(0, index).unsqueeze(1).to(output.dtype)

        handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
