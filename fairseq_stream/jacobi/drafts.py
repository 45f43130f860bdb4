"""Drafts: guesses for the positions after a row's last verified token.

A Jacobi iteration's outputs past its accepted tokens are guesses made from a
partly wrong context; Jacobi feeds them back as the next window (the paper's
iteration, started from PAD). ``--jacobi-draft ngram`` first looks the last
three verified tokens up in a pool of n-grams taken from the sentences this run
has already decoded (lookahead decoding's idea, without a second model) and
drafts their continuation where one is known, then the Jacobi guesses.

The draft only decides how many tokens an iteration can accept: every token
is verified against the model before it is kept. What it costs is window
positions: nearly free for one sentence, one row's work each in a batched
call whose products scale with rows. So ``ngram`` drafts a token only where
its chance of being accepted pays for its position (:func:`next_draft`'s
``threshold``, set by the decoder from the call's rows).
"""

from typing import Dict, List, Optional, Sequence, Tuple

DRAFTS = ("pad", "ngram")
# Pool entries kept before the oldest are dropped (a long run's outputs).
MAX_POOL = 200_000
# How often a Jacobi guess (an output past a rejected draft, computed from a
# wrong input) is the right token: PAD drafts accept 1.07-1.09 tokens per
# iteration on the Multi30k and toy models (docs/BENCHMARKS.md, issue 12).
GUESS_ACCEPTANCE = 0.08


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
        return self.draft(context)[0]

    def draft(self, context: Sequence[int]) -> Tuple[Tuple[int, ...], List[float]]:
        """:meth:`lookup`'s continuation and, per token, the estimated chance that it and those before it are right.

        The chance is the share of the context's seen continuations that
        agree with it up to that token, counting one unseen continuation
        (a context seen once gives 1/2, not certainty).
        """
        for order in self.ORDERS:
            if order <= len(context):
                seen = self.table.get(tuple(context[-order:]))
                if seen:
                    best = max(seen.values())
                    follow = next(f for f in reversed(seen) if seen[f] == best)
                    total = sum(seen.values()) + 1
                    chances = [sum(n for f, n in seen.items() if f[:i] == follow[:i]) / total
                               for i in range(1, len(follow) + 1)]
                    return follow, chances
        return (), []


def next_draft(guesses: List[int], pool, context: Sequence[int], width: int, pad: int,
               threshold: Optional[float] = None) -> List[int]:
    """Draft tokens after ``context`` (the verified tokens): the pool's continuation (if any), then ``guesses``.

    Without ``threshold``: exactly ``width`` tokens, PAD last (the paper's
    fixed window). With one: at most ``width``, and only while the estimated
    chance that the draft is right up to the token stays at least
    ``threshold`` (pool tokens: :meth:`NgramPool.draft`; each guess after
    them: ``GUESS_ACCEPTANCE`` times the chance before it); possibly none.
    """
    if width <= 0:
        return []
    draft, chances = pool.draft(context) if pool is not None else ((), [])
    if threshold is None:
        draft = list(draft[:width])
        draft.extend(guesses[len(draft): width])
        return draft + [pad] * (width - len(draft))
    kept, chance = [], 1.0
    for token, c in zip(draft[:width], chances):
        if c < threshold:
            break
        kept.append(token)
        chance = c
    for token in guesses[len(kept): width]:
        chance *= GUESS_ACCEPTANCE
        if chance < threshold:
            break
        kept.append(token)
    return kept
