"""The static-slot step's two attentions: every row at its own slot, sentence and length, shapes fixed.

Both take the whole pool (every slot) and index it by the rows' vectors, so a
call's shapes are (rows, positions, source) whatever the rows hold: no
packing by sentence, no count of rows read back.

* self-attention is :func:`fairseq_stream.ops.attention.window_attention_`
  with one window position per row (its slot, its length): the compiled
  kernel on the CPU, else its torch form (write by index, gather the rows'
  slots, mask past each row's length);
* encoder attention is the compiled :func:`~fairseq_stream.ops.attention.source_attention`
  on the CPU, else :func:`gathered_source_attention` (each row's sentence's
  keys gathered, the mask added): a copy of the keys per row, where the
  lean runner's torch path packs rows by sentence, a shape that depends on
  the counts.

On CUDA both read the pool in place instead, through
:func:`fairseq_stream.ops.indexed_attention.indexed_attention` (a kernel per
call, shapes fixed as the torch forms'), where it is built: the torch forms'
copies were most of the step's memory traffic at the WMT'19 size
(docs/GPU.md). Eager steps and captured ones take the same path, so a graph
still replays the eager step's kernels.
"""

from torch import Tensor
import torch.nn.functional as F

from fairseq_stream.ops import attention, indexed_attention


def self_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, slot: Tensor, length: Tensor,
                   positions: int, scale: float, compiled: bool) -> Tensor:
    """Write each row's ``k``, ``v`` at its ``length`` in its ``slot``, attend over positions ``0..length``.

    ``positions``: at least every row's length + 1, known on the host (the
    torch form's key length; a bucket of it keeps shapes fixed).
    """
    if indexed_attention.available(q, keys):
        attention.write_rows_(k, v, keys, values, slot, length)
        return indexed_attention.indexed_attention(q, keys, values, slot, None, length, scale)
    return attention.window_attention_(q, k, v, keys, values, slot, length, positions, scale, compiled)


def source_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, sentence: Tensor,
                     compiled: bool) -> Tensor:
    """Each row's query over its sentence slot's encoder keys (``mask``: (slots, 1, 1, source), additive)."""
    if compiled and attention.compiled_applies(q):
        return attention.source_attention(q, keys, values, mask, scale, sentence, None, True)
    if indexed_attention.available(q, keys):
        return indexed_attention.indexed_attention(q, keys, values, sentence, mask, None, scale)
    return gathered_source_attention(q, keys, values, mask, scale, sentence)


def gathered_source_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
                              sentence: Tensor) -> Tensor:
    """Torch: each row's sentence's keys, values and mask gathered, then one query per row and head."""
    rows, (_, H, T, hd) = q.size(0), keys.shape
    query = q.reshape(rows, H, 1, hd)
    k, v, m = keys.index_select(0, sentence), values.index_select(0, sentence), mask.index_select(0, sentence)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=m, scale=scale)
    return out.reshape(rows, H * hd)
