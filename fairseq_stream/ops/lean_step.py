"""The lean runner's decoder layers for one step as one compiled call (CPU).

:meth:`LeanRunner._model_step <fairseq_stream.runners.lean.LeanRunner>` runs,
per layer, the fused projection, the two attentions, the feed-forward block,
three residual sums and three layer norms: about 50 torch ops and calls of our
kernels a step for three layers, each paying Python's and the dispatcher's
fixed cost. At a dozen rows a step (greedy over batches of 64, one Xeon
thread) that cost was about 0.7 ms against 0.4 ms of products.
:func:`lean_layers` (``csrc/cpu/lean_step_cpu.cpp``) makes the same calls from
C++: the same ATen ops, prepacked products and attention kernels in the same
order, so its results are bitwise those of the Python step
(tests/test_lean_step.py), on every path the Python step has (segments,
slots, masks, pre- and post-norm, relu and fairseq's gelu).

It applies where :func:`compile_layers` can describe every layer (CPU
weights, relu or fairseq's ``gelu``, layer norms present) and the attentions
run compiled; elsewhere the runner keeps its Python step.
"""

from typing import List, Optional

import torch.nn.functional as F

from fairseq_stream.ops import product
from fairseq_stream.ops.loader import compiled_module


def _extension():
    module = compiled_module("cpu")
    return module if hasattr(module, "lean_layers") else None


def available() -> bool:
    """Whether the compiled layers are built (CPU extension)."""
    return _extension() is not None


def activation_code(fn) -> Optional[int]:
    """The kernel's code for a fairseq activation function: 0 relu, 1 fairseq's gelu (in float32); None: other."""
    from fairseq.modules.gelu import gelu

    if fn is F.relu:
        return 0
    if fn is gelu:
        return 1
    return None


def _parts(module, activation_fn, norms, products):
    """(activation code, norm weights, compiled products) of one layer, or None where one cannot be described."""
    activation = activation_code(activation_fn)
    if activation is None or any(n is None or n[1] is None or n[2] is None for n in norms):
        return None
    compiled = [product.compiled(module, p) for p in products]
    if any(p is None for p in compiled):
        return None
    return activation, [(n[1], n[2], n[3]) for n in norms], compiled


def compile_layers(layers) -> Optional[List]:
    """The compiled description of the runner's ``_Layer`` objects, or None where one cannot be described."""
    module = _extension()
    if module is None:
        return None
    compiled = []
    for layer in layers:
        parts = _parts(module, layer.activation, (layer.self_norm, layer.cross_norm, layer.final_norm),
                       (layer.qkv, layer.self_out, layer.cross_q, layer.cross_out, layer.fc1, layer.fc2))
        if parts is None:
            return None
        activation, norms, products = parts
        compiled.append(module.LeanLayer(layer.pre_norm, products, norms, layer.scaling, layer.cross_scaling,
                                         activation))
    return compiled


def compile_encoder_layers(layers) -> Optional[List]:
    """The compiled description of encoder layers, or None where one cannot be described.

    ``layers``: dicts of ``pre_norm``, ``products`` (qkv, out, fc1, fc2:
    :func:`fairseq_stream.ops.product.linear`'s), ``norms`` (self-attention's, the
    feed-forward block's: ``(shape, weight, bias, eps)``), ``scaling``,
    ``activation`` (the fairseq function) and ``heads``
    (:class:`fairseq_stream.runners.lean_encoder.LeanEncoder`).
    """
    module = _extension()
    if module is None or not hasattr(module, "lean_encoder_layers"):
        return None
    compiled = []
    for layer in layers:
        parts = _parts(module, layer["activation"], layer["norms"], layer["products"])
        if parts is None:
            return None
        activation, norms, products = parts
        compiled.append(module.LeanEncoderLayer(layer["pre_norm"], products, norms, layer["scaling"], activation,
                                                layer["heads"]))
    return compiled


def lean_encoder_layers(x, compiled, starts, dense_from):
    """Every encoder layer over sources packed without padding: ``x`` (tokens, dim), sentence s rows
    ``starts[s]:starts[s + 1]``; sentences of ``dense_from`` tokens or more attend through batched products."""
    return _extension().lean_encoder_layers(x, compiled, starts, dense_from)


def lean_layers(x, compiled, caches, slots, lengths, starts, enc_keys, enc_values, masks, row_sentences):
    """Every layer of one model for one step: ``x`` (rows, dim) in, the last layer's states out.

    Per segment (rows ``starts[i]:starts[i + 1]``): its cache ``(2 * layers,
    slots, heads, capacity, head_dim)``, slot index or None, length, each
    layer's encoder keys and values, the additive mask or None, and each
    row's sentence. Caches are written in place, as the Python step does.
    """
    return _extension().lean_layers(x, compiled, caches, slots, lengths, starts, enc_keys, enc_values, masks,
                                    row_sentences)


def lean_window_layers(x, compiled, cache, window_row, window_step, enc_keys, enc_values, mask, visible=None):
    """Every layer of one model for one Jacobi window call (:mod:`fairseq_stream.runners.lean_window`).

    ``x`` (positions, dim): window position n is row ``window_row[n]``'s token
    at cache position ``window_step[n]`` (a row is a sentence). The cache is
    written in place, as the Python window call does. ``visible``: a
    tree-shaped window's self-attention mask (``window_attention_``), or None.
    """
    return _extension().lean_window_layers(x, compiled, cache, window_row, window_step, enc_keys, enc_values, mask,
                                           visible)
