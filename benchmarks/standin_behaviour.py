"""Does a model behave like a trained translation model? Read from two fairseq-generate runs.

Streaming's and pruning's figures mean something only on members that end
their hypotheses where a trained model would (issue 53): an untrained
stand-in rarely emits EOS, so every hypothesis runs to the maximum length and
var-beam pruning has nothing to cut. :func:`behaviour` reads the outputs of
``--search fixed`` and ``--search var-batch`` at k=5 on the same sentences,
decoded with fairseq's default length bound (``--max-len-a 0 --max-len-b
200``, no ``--max-len-a`` of ours), and their expansions (rows, as
benchmarks/gpu_probe.py counts them), and gives:

* ``eos_share``: the share of best hypotheses that ended in EOS before the
  bound (fairseq forces EOS at the bound, so a hypothesis that long counts
  as cut);
* ``length_ratio``: the best hypotheses' tokens over the sources' tokens
  (BPE tokens both, summed over the sentences);
* ``expansions_ratio``: var-batch's expansions over fixed's, against the
  Multi30k transformer's 0.56 at k=5 (docs/pruning.md: 44,436 against
  79,110 on the test set).

``trained_like`` is all three within :data:`LIMITS`. gpu_bench.py runs it
on its stand-in before the timed decodes and drops the length bound it
needs for untrained weights when the stand-in passes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import hypotheses  # noqa: E402

FAIRSEQ_MAX_LEN_B = 200
# docs/pruning.md's table: var-batch (δ=1.5, M=5) and fixed at k=5, Multi30k De-En, 1,000 sentences.
MULTI30K_EXPANSIONS_RATIO_K5 = round(44436 / 79110, 3)
# What a trained model shows, loosely: nearly every hypothesis ends by itself, at a length near the
# source's (De-En BPE), and pruning cuts a good share of the fixed beam's expansions.
LIMITS = {"eos_share": (0.9, 1.0), "length_ratio": (0.5, 2.0), "expansions_ratio": (0.0, 0.9)}


def sources(path):
    """fairseq-generate's S- lines: {sentence id: text}; {} if the file is missing."""
    out = {}
    if not path or not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("S-"):
                head, text = (line.rstrip("\n").split("\t", 1) + [""])[:2]
                out[int(head[2:])] = text
    return out


def behaviour(fixed_output, var_output, fixed_rows, var_rows, max_len=FAIRSEQ_MAX_LEN_B):
    """The figures above from fixed's and var-batch's generate-test.txt and their expansions."""
    hyps, srcs = hypotheses(fixed_output) or {}, sources(fixed_output)
    ids = sorted(set(hyps) & set(srcs))
    if not ids:
        return {"error": "no hypotheses in {}".format(fixed_output)}
    lengths = [len(hyps[i][1].split()) for i in ids]
    # A hypothesis of max_len tokens plus EOS is one fairseq stopped: the EOS was forced.
    ended = sum(1 for n in lengths if n + 1 < max_len)
    source_lengths = sorted(len(srcs[i].split()) for i in ids)
    src_tokens = sum(source_lengths)
    result = {
        "sentences": len(ids),
        "max_len": max_len,
        "eos_share": round(ended / len(ids), 3),
        "length_ratio": round(sum(lengths) / max(src_tokens, 1), 3),
        "mean_hypothesis_tokens": round(sum(lengths) / len(ids), 1),
        "median_source_tokens": source_lengths[len(source_lengths) // 2],
        "expansions_ratio": round(var_rows / fixed_rows, 3) if fixed_rows and var_rows is not None else None,
        "multi30k_expansions_ratio": MULTI30K_EXPANSIONS_RATIO_K5,
        "var_batch_sentences": len(hypotheses(var_output) or {}),
    }
    result["trained_like"] = all(result[k] is not None and lo <= result[k] <= hi for k, (lo, hi) in LIMITS.items())
    return result


def too_short(result):
    """Hypotheses far shorter than their sources (a model that says EOS at once): no upper length bound
    makes its decodes take a trained model's steps."""
    return bool(result.get("length_ratio") is not None and result["length_ratio"] < LIMITS["length_ratio"][0]
                and result.get("median_source_tokens"))


def describe(result):
    """One line for a summary."""
    if result.get("error"):
        return result["error"]
    return ("{} sentences, no length bound of ours (max {}): {:.0%} ended in EOS, hypothesis/source length "
            "{:.2f}, var-batch/fixed expansions {} (Multi30k {}): {}".format(
                result["sentences"], result["max_len"], result["eos_share"], result["length_ratio"],
                result["expansions_ratio"], result["multi30k_expansions_ratio"],
                "trained-like" if result["trained_like"] else "NOT trained-like"))
