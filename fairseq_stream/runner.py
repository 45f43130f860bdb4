"""The model runner: encoder and decoder calls on fairseq's ``EnsembleModel``.

It owns the encoder outputs and the incremental decoder states of the rows
being decoded and moves them when rows are selected, duplicated or dropped.
It knows nothing about why rows are chosen (that is the search's and the
scheduler's business).

We gather every incremental buffer ourselves: fairseq's
``MultiheadAttention.reorder_incremental_state`` skips the encoder-attention
buffers whenever the new order has as many rows as the old one, which is only
right when rows never move across sentences.
"""

from typing import List

import torch
from fairseq.models import FairseqIncrementalDecoder
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.sequence_generator import EnsembleModel


class ModelRunner:
    """Encode a batch, then run single-token decoder steps over a changing set of rows.

    Args:
        models: a list of fairseq models (an ensemble of one or more) or an
            ``EnsembleModel``.
        temperature: divides the decoder logits, as fairseq's ``--temperature``.
    """

    def __init__(self, models, temperature: float = 1.0):
        self.model = models if isinstance(models, EnsembleModel) else EnsembleModel(models)
        self.model.eval()
        self.temperature = temperature
        self.encoder_outs = None
        self.row_sentence = None  # (rows,) sentence of each decoder row
        self.incremental_states: List[dict] = []
        self._attention = [
            [m for m in model.decoder.modules() if isinstance(m, MultiheadAttention)]
            for model in self.model.models
        ]

    def max_decoder_positions(self):
        return self.model.max_decoder_positions()

    def start(self, net_input, rows_per_sentence: int):
        """Encode ``net_input`` and make ``rows_per_sentence`` decoder rows per sentence."""
        # Keep every attention buffer per row (no "beamable" sharing of encoder
        # keys across a sentence's rows), so that rows can move freely.
        self.model.set_decoder_beam_size(1)
        encoder_outs = self.model.forward_encoder(net_input)
        bsz = net_input["src_tokens"].size(0)
        order = torch.arange(bsz).repeat_interleave(rows_per_sentence)
        self.row_sentence = order.to(net_input["src_tokens"].device)
        self.encoder_outs = self.model.reorder_encoder_out(encoder_outs, self.row_sentence)
        self.incremental_states = [{} for _ in self.model.models]

    @torch.no_grad()
    def step(self, tokens):
        """Run one decoder step on all current rows.

        Args:
            tokens: (rows, length) target prefixes, all of the same length
                (fairseq gives every row the position ``padding_idx + length``).

        Returns:
            (lprobs (rows, vocab), attention (rows, src_len) or None)
        """
        return self.model.forward_decoder(
            tokens, self.encoder_outs, self.incremental_states, self.temperature
        )

    def reorder(self, new_order: torch.Tensor):
        """Make row ``i`` continue old row ``new_order[i]`` (select, copy or drop rows)."""
        # Encoder outputs and encoder-attention keys depend only on a row's
        # sentence: when every row keeps the sentence it had, they stay as
        # they are (most steps of fixed-width search), else they are gathered.
        new_row_sentence = self.row_sentence.index_select(0, new_order)
        same_sentences = torch.equal(new_row_sentence, self.row_sentence)
        self.row_sentence = new_row_sentence
        if not same_sentences:
            self.encoder_outs = self.model.reorder_encoder_out(self.encoder_outs, new_order)
        for model, state, attentions in zip(
            self.model.models, self.incremental_states, self._attention
        ):
            for attention in attentions:
                buffer = attention._get_input_buffer(state)
                if not buffer or (same_sentences and attention.encoder_decoder_attention):
                    continue
                for key, value in buffer.items():
                    if value is not None:
                        buffer[key] = value.index_select(0, new_order)
                attention._set_input_buffer(state, buffer)
            # Decoders that cache state outside attention modules (the LSTM's
            # hidden and cell states) reorder it themselves; theirs is a plain
            # index_select on every tensor, safe across sentences.
            decoder = model.decoder
            own = type(decoder).reorder_incremental_state
            if own is not FairseqIncrementalDecoder.reorder_incremental_state:
                own(decoder, state, new_order)
