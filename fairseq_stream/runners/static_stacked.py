"""The static-slot step of an ensemble stacked: every product once for all members, one slot pool.

Members of one shape (:func:`fairseq_stream.runners.stacked.unstackable_reason`)
run as the lean runner's :class:`~fairseq_stream.runners.stacked.StackedModel`
over the static-slot runner's memory: the pool holds one model, the stacked
one, so its cache is ``(2 * layers, slots, members * heads, positions,
head_dim)`` and its encoder keys ``(sentence slots, members * heads, source,
head_dim)`` (member m's head h is head ``m * heads + h``). A row's slot and
sentence slot are the same for every member, so a reorder, take or concat is
one index operation for all members, and a step is one call per attention
for all of them: the step's ATen calls do not grow with the members.

Exactness: the stacked model's arithmetic (its products batched where they
read fairseq's weights, each member's otherwise) over the static attentions;
in float64 the n-best lists equal the lean runner's member by member
(tests/test_static_stacked.py).
"""

from typing import List, Optional

from torch import Tensor

from fairseq_stream.ops import attention
from fairseq_stream.runners import static_attention
from fairseq_stream.runners.stacked import StackedModel, choose

# Why --stack-members auto runs the members one after another on the CPU's compiled attention: measured no
# faster stacked there (the members' float32 products stay each member's own, and the stacked layout adds copies
# between them and the attention; docs/ensemble.md, benchmarks/bench_static.py --members 4).
CPU_AUTO_DECLINED = "auto: member by member is as fast on the CPU (--stack-members on stacks them)"


def stacked_members(members, stack_members: Optional[bool], compiled_attention: bool):
    """(a :class:`StackedModel` or None, why not: "" where stacked) for the static-slot runner.

    ``stack_members`` as the lean runner's; auto stacks on CUDA and, on the
    CPU, as :data:`CPU_AUTO_DECLINED` says.
    """
    on_cpu = compiled_attention and attention.compiled_applies(members[0].embed)
    return choose(members, stack_members, CPU_AUTO_DECLINED if on_cpu else "")


def forward_static(model: StackedModel, pool, tokens: Tensor, slot: Tensor, sentence: Tensor, length: Tensor,
                   positions: int, compiled: bool) -> List[Tensor]:
    """Each member's logits for rows at (``slot``, ``sentence``, ``length``): the static-slot runner's
    ``forward_static`` over the stacked pool (``pool.caches[0]``, ``pool.keys[0]``: the stacked model's)."""
    first = model.members[0]
    cache, keys, values, mask = pool.caches[0], pool.keys[0], pool.values[0], pool.masks[0]
    where = None if first.positions is None else length + (first.padding_idx + 1)

    def self_attention(l, layer, q, k, v):
        return static_attention.self_attention(q, k, v, cache[2 * l], cache[2 * l + 1], slot, length, positions,
                                               layer.scaling, compiled)

    def source_attention(l, layer, q):
        return static_attention.source_attention(q, keys[l], values[l], mask, layer.cross_scaling, sentence,
                                                 compiled)

    return model.step(tokens, where, self_attention, source_attention)
