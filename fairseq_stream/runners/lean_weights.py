"""The pieces of a fairseq transformer's weights as the lean code runs them: norms and fused products.

Shared by the lean decoder (:mod:`fairseq_stream.runners.lean_model`) and the
lean encoder (:mod:`fairseq_stream.runners.lean_encoder`).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from fairseq_stream.ops import product


def norm_of(module):
    """(shape, weight, bias, eps) of a LayerNorm, or None."""
    if module is None:
        return None
    return (module.normalized_shape, module.weight, module.bias, module.eps)


def apply_norm(x, norm):
    shape, weight, bias, eps = norm
    return F.layer_norm(x, shape, weight, bias, eps)


def joined_linear(modules, prepack: bool, quantize: Optional[str] = None) -> product.Linear:
    """One product for the ``nn.Linear`` modules' outputs side by side (fused projections).

    ``quantize``: "int8" (int8w8, int8w7) or "int16" for a product on the weight quantized
    (:mod:`fairseq_stream.ops.quantized_linear`), None for float: packed for MKL where ``prepack``.
    """
    weight = modules[0].weight if len(modules) == 1 else torch.cat([m.weight for m in modules])
    biases = [m.bias for m in modules]
    bias = None if biases[0] is None else (biases[0] if len(modules) == 1 else torch.cat(biases))
    return product.linear(weight, bias, quantize or ("float32" if prepack else "plain"))
