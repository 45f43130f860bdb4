"""Drafts: guesses for the positions after a row's last verified token.

A Jacobi iteration's outputs past its accepted tokens are guesses made from a
partly wrong context; Jacobi feeds them back as the next window (the paper's
iteration, started from PAD). ``--jacobi-draft ngram`` first looks the last
three verified tokens up in a pool of n-grams taken from the sentences this run
has already decoded (lookahead decoding's idea, without a second model) and
drafts their continuation where one is known, then the Jacobi guesses.

The draft only decides how many tokens an iteration can accept: every token
is verified against the model before it is kept.
"""

from typing import Dict, List, Sequence, Tuple

DRAFTS = ("pad", "ngram")
# Pool entries kept before the oldest are dropped (a long run's outputs).
MAX_POOL = 200_000


class NgramPool:
    """Continuations of one- to three-token contexts seen in the run's verified outputs.

    A context keeps the continuations it was seen with and their counts;
    the most frequent one is drafted (the newest among equals), from the
    longest context that is known.

    Args:
        span: tokens kept after each context (a window's draft length).
    """

    ORDERS = (3, 2, 1)

    def __init__(self, span: int):
        self.span = max(1, span)
        self.table: Dict[Tuple[int, ...], Dict[Tuple[int, ...], int]] = {}

    def add_output(self, tokens: Sequence[int]):
        """Learn every context of a finished sentence's tokens (BOS first, EOS last)."""
        tokens = list(tokens)
        table, span = self.table, self.span
        for i in range(len(tokens) - 1):
            follow = tuple(tokens[i + 1: i + 1 + span])
            for order in self.ORDERS:
                if order <= i + 1:
                    seen = table.setdefault(tuple(tokens[i + 1 - order: i + 1]), {})
                    # Re-inserted last: among equal counts the newest comes last.
                    seen[follow] = seen.pop(follow, 0) + 1
        if len(table) > MAX_POOL:
            for key in list(table)[: len(table) - MAX_POOL]:
                del table[key]

    def lookup(self, context: Sequence[int]) -> Tuple[int, ...]:
        """The most frequent continuation of the longest known suffix of ``context``, or ()."""
        for order in self.ORDERS:
            if order <= len(context):
                seen = self.table.get(tuple(context[-order:]))
                if seen:
                    best = max(seen.values())
                    return next(f for f in reversed(seen) if seen[f] == best)
        return ()


def next_draft(guesses: List[int], pool, context: Sequence[int], width: int, pad: int) -> List[int]:
    """``width`` draft tokens after ``context`` (the verified tokens): the pool's continuation (if any), then ``guesses``, then PAD."""
    draft = list(pool.lookup(context)) if pool is not None else []
    if len(draft) < width:
        draft.extend(guesses[len(draft): width])
    if len(draft) < width:
        draft.extend([pad] * (width - len(draft)))
    return draft[:width]
