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
its chance of being accepted pays for its position (:func:`likely_draft`'s
``threshold``, set by the decoder from the call's rows).
"""

import itertools
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
    the one likeliest token by token is drafted (:meth:`draft`), from the
    longest context that is known.

    What a lookup costs does not grow with the pool: per context, each
    continuation prefix's count and the best continuation below it are kept
    up to date as outputs are learnt (:meth:`_learn`), in steps of the draft
    span. Recomputing a common context's draft from its hundreds of
    continuations after each sentence made a Jacobi iteration 9% dearer
    after 1,000 Multi30k sentences than after 150 (docs/HISTORY.md,
    Jacobi).

    Args:
        span: tokens kept after each context (a window's draft length).
        candidates: how many continuations :meth:`candidates` may be asked
            for (above 1, the pool keeps what it needs up to date as it learns).
    """

    ORDERS = (3, 2, 1)

    def __init__(self, span: int, candidates: int = 1):
        self.span = max(1, span)
        self.top_size = int(candidates)
        # Per context: each continuation's count, in the order of their last sighting (the newest last).
        self.table: Dict[Tuple[int, ...], Dict[Tuple[int, ...], int]] = {}
        # Per context: how often each continuation prefix was seen, and in all.
        self.prefixes: Dict[Tuple[int, ...], Dict[Tuple[int, ...], int]] = {}
        self.totals: Dict[Tuple[int, ...], int] = {}
        # Per context and prefix p (() the context itself): the likeliest continuation through p, as
        # (counts of its prefixes below p, the tick it was last seen, the continuation): draft()'s ranking.
        self.best: Dict[Tuple[int, ...], Dict[Tuple[int, ...], Tuple[Tuple[int, ...], int, Tuple[int, ...]]]] = {}
        self.tick = 0
        # For candidates(), kept up to date as outputs are learnt (a window's draft is looked up every
        # iteration; ranking a common context's hundreds of continuations each time cost more than
        # the positions the candidates saved): per context, its most frequent continuations (the
        # newest first among equals).
        self.top: Dict[Tuple[int, ...], List[Tuple[int, ...]]] = {}

    def add_output(self, tokens: Sequence[int]):
        """Learn every context of a finished sentence's tokens (BOS first, EOS last)."""
        tokens = list(tokens)
        span = self.span
        for i in range(len(tokens) - 1):
            follow = tuple(tokens[i + 1: i + 1 + span])
            for order in self.ORDERS:
                if order <= i + 1:
                    self._learn(tuple(tokens[i + 1 - order: i + 1]), follow)
        if len(self.table) > MAX_POOL:
            # The oldest contexts go, a tenth of the pool at a time: one pass over the pool per
            # MAX_POOL / 10 new contexts, not one per sentence.
            for key in list(itertools.islice(self.table, len(self.table) - MAX_POOL * 9 // 10)):
                for kept in (self.table, self.prefixes, self.totals, self.best, self.top):
                    kept.pop(key, None)

    def _learn(self, key: Tuple[int, ...], follow: Tuple[int, ...]):
        """Count one more ``follow`` of ``key``: its count, its prefixes' counts, the best continuations through them."""
        seen = self.table.setdefault(key, {})
        # Re-inserted last: among equal counts the newest comes last.
        seen[follow] = seen.pop(follow, 0) + 1
        self.totals[key] = self.totals.get(key, 0) + 1
        prefixes = self.prefixes.setdefault(key, {})
        nodes = [follow[:i] for i in range(len(follow) + 1)]  # () (the context itself), then each prefix
        for node in nodes[1:]:
            prefixes[node] = prefixes.get(node, 0) + 1
        # Only the prefixes of ``follow`` changed: each one's best is the old one or the one through
        # its child on ``follow`` (whose count grew), from the longest prefix up to the context.
        self.tick += 1
        best = self.best.setdefault(key, {})
        below = ((), self.tick, follow)
        for d in range(len(follow), -1, -1):
            node = nodes[d]
            if d < len(follow):
                counts, tick, leaf = below
                below = ((prefixes[nodes[d + 1]],) + counts, tick, leaf)
            old = best.get(node)
            if old is None or below > old:
                best[node] = below
            else:
                below = old
        if self.top_size > 1:
            self._rank(key, seen, follow)

    def _rank(self, key: Tuple[int, ...], seen: Dict[Tuple[int, ...], int], follow: Tuple[int, ...]):
        """Place ``follow`` in ``key``'s most frequent continuations (its count in ``seen`` is updated)."""
        top = self.top.setdefault(key, [])
        # A count only grows by one, so the continuation only moves up; among equals the newest first.
        if follow in top:
            i = top.index(follow)
            del top[i]
        elif len(top) < self.top_size or seen[follow] >= seen[top[-1]]:
            i = len(top)
        else:
            return
        count = seen[follow]
        while i > 0 and seen[top[i - 1]] <= count:
            i -= 1
        top.insert(i, follow)
        del top[self.top_size:]

    def lookup(self, context: Sequence[int]) -> Tuple[int, ...]:
        """:meth:`draft`'s continuation of the longest known suffix of ``context``, or ()."""
        return self.draft(context)[0]

    def draft(self, context: Sequence[int]) -> Tuple[Tuple[int, ...], List[float]]:
        """:meth:`lookup`'s continuation and, per token, the estimated chance that it and those before it are right.

        The continuation is the one whose tokens are likeliest position by
        position: compared by how often their first token was seen first,
        then their first two tokens, and so on (counting every continuation
        that begins with them), the newest among equals. The single most
        frequent continuation may begin with a less likely token: (a, b) and
        (a, c) twice each against (d, e) three times. The chance is the
        share of the context's seen continuations that agree with it up to
        that token, counting one unseen continuation (a context seen once
        gives 1/2, not certainty).
        """
        for order in self.ORDERS:
            if order <= len(context):
                key = tuple(context[-order:])
                best = self.best.get(key)
                if best:
                    counts, _, follow = best[()]
                    total = self.totals[key] + 1
                    return follow, [n / total for n in counts]
        return (), []

    def candidates(self, context: Sequence[int], count: int) -> List[Tuple[Tuple[int, ...], float]]:
        """Up to ``count`` continuations of ``context`` as trie nodes: (tokens after the context, estimated chance).

        The longest known context's continuations, most frequent first, then
        the shorter contexts' that are not among them (lookahead decoding
        verifies several n-grams per step; on Multi30k more candidates verify
        more tokens, docs/BENCHMARKS.md). A node's chance is the share of its
        context's seen continuations that begin with it (one unseen counted,
        as :meth:`draft`), from the longest context that has it. Nodes come
        in depth-first order of their continuations, which are ranked by
        their whole count: the first need not be :meth:`draft`'s chain (the
        likeliest token by token), which :func:`likely_tree` places first.
        ``count`` is at most the pool's ``candidates``.
        """
        count = min(count, self.top_size)
        out: List[Tuple[Tuple[int, ...], float]] = []
        placed = set()
        follows = 0
        for order in self.ORDERS:
            if order > len(context) or follows >= count:
                continue
            key = tuple(context[-order:])
            top = self.top.get(key)
            if not top:
                continue
            prefixes, total = self.prefixes[key], self.totals[key] + 1
            for follow in top:
                if follows >= count:
                    break
                if follow in placed:
                    continue
                follows += 1
                for i in range(1, len(follow) + 1):
                    node = follow[:i]
                    if node not in placed:
                        placed.add(node)
                        out.append((node, prefixes[node] / total))
        return out


def next_draft(guesses: List[int], pool, context: Sequence[int], width: int, pad: int) -> List[int]:
    """The paper's fixed window: ``width`` draft tokens after ``context`` (the verified tokens).

    The pool's continuation (if any), then ``guesses``, then PAD.
    """
    if width <= 0:
        return []
    draft = list(pool.lookup(context)[:width]) if pool is not None else []
    draft.extend(guesses[len(draft): width])
    return draft + [pad] * (width - len(draft))


class AcceptanceRates:
    """How often drafts were right in this run, by their estimated chance: the estimates, calibrated.

    The pool's shares are estimates from few counts (a context seen twice
    with one continuation says 2/3); what decides whether a draft token pays
    is how often such tokens are accepted. Each verified draft token is
    recorded under its estimate's tenth (pool and guesses apart), and the
    chance used is the measured rate, starting from the estimate itself
    (``PRIOR`` pseudo-observations).
    """

    BUCKETS = 10
    PRIOR = 8.0

    def __init__(self):
        self.tried = [[0] * self.BUCKETS for _ in range(2)]
        self.right = [[0] * self.BUCKETS for _ in range(2)]

    def _bucket(self, estimate: float) -> int:
        return min(int(estimate * self.BUCKETS), self.BUCKETS - 1)

    def chance(self, estimate: float, guess: bool) -> float:
        """The measured chance of a draft token whose estimated chance is ``estimate``."""
        b = self._bucket(estimate)
        return (self.right[guess][b] + self.PRIOR * estimate) / (self.tried[guess][b] + self.PRIOR)

    def record(self, estimates: Sequence[Tuple[float, bool]], right: int, accepted: Optional[Sequence[bool]] = None):
        """A verified draft: its tokens' (estimate, guess) pairs, of which the first ``right`` were accepted.

        ``accepted``, for a tree of drafts: per token, whether it was accepted (``right`` is then unused).
        """
        for i, (estimate, guess) in enumerate(estimates):
            b = self._bucket(estimate)
            self.tried[guess][b] += 1
            self.right[guess][b] += accepted[i] if accepted is not None else i < right


def likely_draft(guesses: List[int], pool, context: Sequence[int], width: int, threshold: float,
                 rates: AcceptanceRates) -> Tuple[List[int], List[Tuple[float, bool]]]:
    """The draft tokens after ``context`` that pay for their window positions, and their estimates.

    At most ``width`` tokens: the pool's continuation, then ``guesses``,
    kept while the chance that the draft is right up to the token (``rates``
    applied to the estimate: :meth:`NgramPool.draft`'s share for pool tokens,
    ``GUESS_ACCEPTANCE`` times the estimate before for each guess) is at
    least ``threshold``; possibly none. The estimates go back to
    :meth:`AcceptanceRates.record` once the draft is verified.
    """
    if width <= 0:
        return [], []
    draft, shares = pool.draft(context) if pool is not None else ((), [])
    kept, estimates, estimate = [], [], 1.0
    for token, share in zip(draft[:width], shares):
        if rates.chance(share, False) < threshold:
            break
        kept.append(token)
        estimates.append((share, False))
        estimate = share
    for token in guesses[len(kept): width]:
        estimate *= GUESS_ACCEPTANCE
        if rates.chance(estimate, True) < threshold:
            break
        kept.append(token)
        estimates.append((estimate, True))
    return kept, estimates


def likely_tree(guesses: List[int], pool, context: Sequence[int], width: int, threshold: float,
                rates: AcceptanceRates, count: int):
    """A tree of drafts: up to ``width`` tokens, from :func:`likely_draft`'s chain and the pool's other candidates.

    Returns (tokens, parents, estimates): the draft tokens in window order
    (the chain's first), each token's parent as a window index (0 is the
    last verified token, the window's first position), and their estimates
    for :meth:`AcceptanceRates.record`. ``parents`` is None when the draft
    is a chain: the window is then laid out as before.

    The block stays a budget of positions: a window still holds at most
    ``width`` drafts, at depth at most ``width``; with several candidates
    (up to ``count`` looked at) they go to the likeliest tokens, each
    kept only where its chance (``rates`` applied to its share, as the
    chain's) is at least ``threshold``, and never without its parent.
    """
    chain, chain_estimates = likely_draft(guesses, pool, context, width, threshold, rates)
    if count <= 1 or pool is None or width <= 0:
        return chain, None, chain_estimates
    nodes: Dict[Tuple[int, ...], Tuple[float, Tuple[float, bool]]] = {}
    for i, estimate in enumerate(chain_estimates):
        nodes[tuple(chain[: i + 1])] = (rates.chance(*estimate), estimate)
    for node, share in pool.candidates(context, count):
        if node in nodes or len(node) > width or (len(node) > 1 and node[:-1] not in nodes):
            continue
        chance = rates.chance(share, False)
        if chance >= threshold:
            nodes[node] = (chance, (share, False))
    kept = set(nodes)
    if len(nodes) > width:
        kept = set()
        for node in sorted(nodes, key=lambda n: (-nodes[n][0], len(n))):
            if len(node) == 1 or node[:-1] in kept:
                kept.add(node)
                if len(kept) == width:
                    break
    order = [n for n in nodes if n in kept]  # the chain's first, then the candidates' depth-first
    if all(len(n) == i + 1 and n == tuple(chain[: i + 1]) for i, n in enumerate(order)):
        return list(chain[: len(order)]), None, chain_estimates[: len(order)]
    index = {n: i + 1 for i, n in enumerate(order)}
    return ([n[-1] for n in order], [index.get(n[:-1], 0) for n in order], [nodes[n][1] for n in order])
