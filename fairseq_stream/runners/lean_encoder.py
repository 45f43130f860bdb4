"""fairseq's transformer encoder over a batch's sources packed without padding, in one compiled call (CPU).

The lean runner encodes each batch once, then decodes it for many steps, so
the encoder was left to fairseq. At small batches that costs more than it
computes: on one Xeon thread, greedy decoding of the Multi30k test set one
sentence at a time spent 0.39 s of 2.5 s in fairseq's encoder (2.6 ms a
sentence for about 0.7 ms of products; the rest is a dozen modules and
``F.multi_head_attention_forward``'s checks per layer). And a batch in input
order runs every padded position of its longest source.

:class:`LeanEncoder` runs the same arithmetic on the batch's tokens only,
sentences side by side ("packed"): the embedding and positions as fairseq's
``forward_embedding`` makes them, then every layer in one call of
``lean_encoder_layers`` (``csrc/cpu/lean_step_cpu.cpp``): the products,
each token's attention over its own sentence (``sentence_attention``: no
padding, so no mask), the residual sums, norms and feed-forward blocks. A
token's result does not depend on the batch.

Exactness: fairseq's arithmetic in another order (fused projections, the
attention loops); in float64 the lean runner's n-best equal the fairseq
runner's (tests/test_lean_runner.py), and the keys equal fairseq's encoder's
to rounding (tests/test_lean_encoder.py). Where :func:`unsupported_reason`
names something (another encoder class, xformers, a quantized or
NormFormer layer), or off the CPU, the runner keeps fairseq's encoder.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_stream.ops import lean_step
from fairseq_stream.runners.lean_weights import joined_linear, norm_of

# Sentences of at least this many tokens attend through batched products rather than a loop per token
# and head (sentence_attention): the loops' cost grows with the length squared at a few GFLOP/s, the
# products' at tens. Multi30k transformer, one Xeon thread: the loops win below ~32 tokens
# (tests/test_lean_encoder.py checks both paths; docs/BENCHMARKS.md, the lean encoder).
DENSE_FROM = 32


def unsupported_reason(encoder) -> Optional[str]:
    """Why :class:`LeanEncoder` cannot run ``encoder`` (None if it can)."""
    from fairseq.models.transformer import TransformerEncoderBase
    from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

    name = type(encoder).__name__
    if not isinstance(encoder, TransformerEncoderBase):
        return "{} is not a fairseq transformer encoder".format(name)
    for method in ("forward", "forward_scriptable", "forward_embedding", "forward_torchscript"):
        if getattr(type(encoder), method) is not getattr(TransformerEncoderBase, method):
            return "{} has its own {}".format(name, method)
    if encoder.quant_noise is not None or getattr(encoder, "return_fc", False):
        return "{} uses quantization noise or returns its feed-forward states".format(name)
    if encoder.embed_positions is not None and type(encoder.embed_positions) not in (
            LearnedPositionalEmbedding, SinusoidalPositionalEmbedding):
        return "{} has unknown positions".format(name)
    for layer in _layers(encoder):
        if type(layer).forward is not TransformerEncoderLayerBase.forward:
            return "{}'s layers have their own forward".format(name)
        attention = layer.self_attn
        if attention.bias_k is not None or attention.add_zero_attn or not attention.qkv_same_dim:
            return "{}'s self-attention adds keys or has keys of another size".format(name)
        if getattr(attention, "use_xformers", False):
            return "{} uses xformers attention".format(name)
        if lean_step.activation_code(layer.activation_fn) is None:
            return "{} has an activation the compiled layers do not know".format(name)
        if layer.self_attn_layer_norm is None or layer.final_layer_norm is None:
            return "{}'s layers lack a layer norm".format(name)
    return None


def _layers(encoder) -> List:
    # Every layer, whatever the layer drop: LayerDropModuleList drops only in training.
    return [encoder.layers[i] for i in range(len(encoder.layers))]


class LeanEncoder:
    """One fairseq transformer encoder's weights, arranged for :func:`lean_step.lean_encoder_layers`.

    With ``prepack`` the float32 products are the decoder's
    (:mod:`fairseq_stream.ops.product`: packed once for MKL's GEMM, oneDNN's
    for big weights on a CPU that is not Intel's, panels for weights of 4M
    values and up), so they take our kernel threads. Without it they are
    ``at::linear`` on fairseq's weights: torch's one thread under our thread
    layout, and MKL's generic code on an AMD CPU. The WMT'19-sized stand-in's
    encoder, one Zen 4 EPYC core (2026-12-05): 1.3x faster packed at 4
    sentences and 1.07x at 64; on two kernel threads 2.4x and 2.0x. Its cost
    is a second copy of the encoder's products (about 0.5 GB for each model
    of a WMT'19 ensemble). The joined query/key/value weight is a copy either way.

    Args:
        encoder: a ``TransformerEncoder`` that :func:`unsupported_reason` accepts.
        position_table: every position's embedding, as ``LeanModel``'s
            ``_position_table`` makes it for this encoder (None: no positions).
        quantize: "int8" (int8w8, int8w7) or "int16": the products on the weights quantized
            (:mod:`fairseq_stream.ops.quantized_linear`); None: float products.
        prepack: float products packed as above (``LeanModel`` passes its own
            ``prepack``); False: ``at::linear`` on fairseq's weights, the reference arithmetic.
    """

    def __init__(self, encoder, position_table: Optional[Tensor], quantize: Optional[str] = None,
                 prepack: bool = False):
        self.padding_idx = encoder.padding_idx
        self.embed = encoder.embed_tokens.weight
        self.embed_scale = encoder.embed_scale
        self.positions = position_table
        self.embed_norm = norm_of(encoder.layernorm_embedding)
        self.final_norm = norm_of(encoder.layer_norm)
        layers = []
        for layer in _layers(encoder):
            attention = layer.self_attn
            layers.append(dict(
                pre_norm=layer.normalize_before,
                products=[joined_linear(modules, prepack, quantize) for modules in (
                    [attention.q_proj, attention.k_proj, attention.v_proj], [attention.out_proj], [layer.fc1],
                    [layer.fc2])],
                norms=[norm_of(layer.self_attn_layer_norm), norm_of(layer.final_layer_norm)],
                scaling=attention.scaling, activation=layer.activation_fn, heads=attention.num_heads))
        self.products = [layer["products"] for layer in layers]  # each layer's, for an account of its weights
        self.compiled = lean_step.compile_encoder_layers(layers)  # None: fairseq's encoder only

    def applies(self, src_tokens: Tensor) -> bool:
        """Whether these sources can be encoded here: compiled layers, on the CPU, in float32 or float64."""
        return (self.compiled is not None and src_tokens.is_cpu and src_tokens.dim() == 2
                and self.embed.dtype in (torch.float32, torch.float64))

    def encode(self, src_tokens: Tensor, dense_from: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """The last layer's states of every non-padding token, sentence after sentence, and each sentence's length.

        Returns ``(states (tokens, dim), lengths (sentences,))``: sentence
        s is rows ``lengths[:s].sum()`` on, as fairseq's encoder output at
        its non-padding positions.
        """
        keep = src_tokens.ne(self.padding_idx)
        lengths = keep.sum(dim=1)
        tokens = src_tokens[keep]
        x = self.embed_scale * F.embedding(tokens, self.embed)
        if self.positions is not None:
            # fairseq's make_positions: padding_idx + the token's place among its sentence's non-padding ones.
            where = (keep.cumsum(dim=1) + self.padding_idx)[keep]
            x = x + self.positions.index_select(0, where)
        if self.embed_norm is not None:
            x = F.layer_norm(x, *self.embed_norm)
        starts = [0] + lengths.cumsum(0).tolist()
        x = lean_step.lean_encoder_layers(x, self.compiled, starts, DENSE_FROM if dense_from is None else dense_from)
        if self.final_norm is not None:
            x = F.layer_norm(x, *self.final_norm)
        return x, lengths
