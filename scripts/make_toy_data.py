#!/usr/bin/env python3
"""Generate a small, deterministic synthetic translation task.

The task is designed so that a tiny seq2seq model learns it to a useful (but
not perfect) level within about a minute of CPU training, while still
requiring attention:

* source sentences are 1-30 tokens drawn from ``s0 .. s{V-1}``;
* every source token is mapped through a fixed random bijection to a target
  token ``t0 .. t{V-1}`` (a "lexicon");
* the mapped sequence is then locally reordered, like adjective/noun order
  between languages: a "modifier" source token (``s0 .. s59``, the first 20%
  of the vocabulary) swaps places with the token that follows it; the pair is
  then done, so ``s1 s2 s7`` -> ``t(2) t(1) t(7)``.

Example: ``s5 s90 s2 s91 s92`` -> ``t(90) t(5) t(91) t(2) t(92)`` where ``t(x)``
is the bijection.

The reordering is triggered by content rather than by position parity on
purpose: a tiny transformer with sinusoidal positions learns content-triggered
swaps within a few epochs, but barely learns parity-based swaps.

Usage::

    python scripts/make_toy_data.py OUT_DIR [--seed 1]
        [--train 6000 --valid 200 --test 37] [--empty-test-lines N]

Writes ``OUT_DIR/{train,valid,test}.{src,tgt}``. The same arguments always
produce byte-identical files (only the stdlib ``random`` module is used, seeded
with strings, which are hashed with SHA-512 and therefore independent of
``PYTHONHASHSEED`` and the platform).
"""

import argparse
import os
import random
from typing import List, Sequence, Tuple

VOCAB_SIZE = 300
# Source ids below this are "modifiers" that swap with the next token.
NUM_MODIFIERS = 60
MIN_LEN = 1
MAX_LEN = 30


def make_lexicon(seed: int, vocab_size: int = VOCAB_SIZE) -> List[int]:
    """Return a fixed random permutation mapping source ids to target ids."""
    perm = list(range(vocab_size))
    random.Random(f"toy-lexicon-{seed}").shuffle(perm)
    return perm


def translate(src_ids: Sequence[int], lexicon: Sequence[int]) -> List[int]:
    """Map source ids through ``lexicon`` and apply the modifier swaps.

    Scanning left to right, a modifier (id < ``NUM_MODIFIERS``) that is not the
    last token swaps with its successor, and the scan skips past the pair.
    """
    mapped = [lexicon[i] for i in src_ids]
    i = 0
    while i < len(mapped) - 1:
        if src_ids[i] < NUM_MODIFIERS:
            mapped[i], mapped[i + 1] = mapped[i + 1], mapped[i]
            i += 2
        else:
            i += 1
    return mapped


def make_split(
    name: str, size: int, seed: int, lexicon: Sequence[int]
) -> List[Tuple[str, str]]:
    """Generate ``size`` (source, target) sentence pairs for split ``name``.

    Each split has its own RNG stream, so changing the size of one split does
    not change the contents of the others.
    """
    rng = random.Random(f"toy-split-{name}-{seed}")
    vocab_size = len(lexicon)
    pairs = []
    for _ in range(size):
        length = rng.randint(MIN_LEN, MAX_LEN)
        src_ids = [rng.randrange(vocab_size) for _ in range(length)]
        tgt_ids = translate(src_ids, lexicon)
        pairs.append(
            (
                " ".join(f"s{i}" for i in src_ids),
                " ".join(f"t{i}" for i in tgt_ids),
            )
        )
    return pairs


def empty_line_positions(num_sentences: int, num_empty: int) -> List[int]:
    """Return the line indices at which empty lines are placed.

    The empty lines are spread evenly over the final file (which has
    ``num_sentences + num_empty`` lines); the first one is always line 0.
    """
    total = num_sentences + num_empty
    return [k * total // num_empty for k in range(num_empty)]


def insert_empty_lines(
    pairs: List[Tuple[str, str]], num_empty: int
) -> List[Tuple[str, str]]:
    """Insert ``num_empty`` empty (source, target) pairs at fixed positions.

    The non-empty pairs keep their relative order, so the test set with empty
    lines is the plain test set plus blanks.
    """
    if num_empty <= 0:
        return list(pairs)
    positions = set(empty_line_positions(len(pairs), num_empty))
    it = iter(pairs)
    return [
        ("", "") if i in positions else next(it)
        for i in range(len(pairs) + num_empty)
    ]


def write_split(out_dir: str, name: str, pairs: Sequence[Tuple[str, str]]) -> None:
    """Write ``pairs`` to ``OUT_DIR/NAME.src`` and ``OUT_DIR/NAME.tgt``."""
    for side, idx in (("src", 0), ("tgt", 1)):
        path = os.path.join(out_dir, f"{name}.{side}")
        # newline="\n" keeps the output byte-identical across platforms.
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for pair in pairs:
                f.write(pair[idx] + "\n")


def main(argv=None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train", type=int, default=6000)
    parser.add_argument("--valid", type=int, default=200)
    # 37 on purpose: not a multiple of typical batch sizes / multiples (8).
    parser.add_argument("--test", type=int, default=37)
    parser.add_argument(
        "--empty-test-lines",
        type=int,
        default=0,
        metavar="N",
        help="insert N empty lines (source and target) into the test split, "
        "in addition to the --test sentences",
    )
    args = parser.parse_args(argv)
    if args.empty_test_lines < 0:
        parser.error("--empty-test-lines must be >= 0")

    os.makedirs(args.out_dir, exist_ok=True)
    lexicon = make_lexicon(args.seed)
    for name, size in (("train", args.train), ("valid", args.valid), ("test", args.test)):
        pairs = make_split(name, size, args.seed, lexicon)
        if name == "test":
            pairs = insert_empty_lines(pairs, args.empty_test_lines)
        write_split(args.out_dir, name, pairs)


if __name__ == "__main__":
    main()
