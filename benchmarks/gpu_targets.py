"""Issue 53's and 52's GPU targets, computed from gpu_bench.py's decode runs.

Each target compares runs of one gpu_bench invocation (same stand-in, same
sentences, same precision); a target whose runs did not decode (a failure,
the deadline) is reported with ``met`` None and the runs it lacks:

* host time per decoder call <= 0.3 ms and GPU busy >= 85%, on the static
  step captured in CUDA graphs (issue 53);
* var-stream k=5 >= 5x the sentences per second of fairseq's ``--beam 5``
  at BLEU within 0.3, on the static step in graphs and on the lean runner;
* var-stream >= 1.15x var-batch at k=50 (the same runner each);
* Jacobi >= 1.3x greedy, one sentence a call (gpu_bench decodes by batch;
  the ratio is reported as measured), with greedy's tokens;
* 4 stacked members <= 2x one member's time (issue 52), and the stacked
  ensemble against the same members one after another.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import hypotheses  # noqa: E402


def per_s(run):
    return run["sentences"] / run["decode_s"] if run and run.get("decode_s") else None


def entry(target, goal, value, met, runs, detail=""):
    return {"target": target, "goal": goal, "value": value, "met": met, "runs": runs, "detail": detail}


def missing(target, goal, runs, have):
    lacking = [r for r in runs if not have.get(r)]
    return entry(target, goal, None, None, runs, "not decoded: " + ", ".join(lacking))


def host_targets(runs):
    """Host ms per call and GPU busy share of the graph-captured runs."""
    out = []
    for name in ("fixed-graphs-k5", "var-stream-graphs-k5", "greedy-graphs"):
        r = runs.get(name)
        if not r:
            out.append(missing("host ms/call, " + name, "<= 0.3", [name], runs))
            continue
        host, busy = r.get("host_ms_per_call"), r.get("gpu_busy")
        out.append(entry("host ms/call, " + name, "<= 0.3", host, None if host is None else host <= 0.3, [name]))
        out.append(entry("GPU busy, " + name, ">= 0.85", busy, None if busy is None else busy >= 0.85, [name],
                         "" if busy is not None else "no NVML figure (CPU, or no pynvml)"))
    return out


def ratio_target(runs, target, goal, numerator, denominator, test, speed=True):
    """``numerator``'s speed over ``denominator``'s (sentences per second), or time over time."""
    a, b = runs.get(numerator), runs.get(denominator)
    if not (a and b and per_s(a) and per_s(b)):
        return missing(target, goal, [numerator, denominator], runs)
    value = per_s(a) / per_s(b) if speed else per_s(b) / per_s(a)
    return entry(target, goal, round(value, 3), test(value), [numerator, denominator])


def beam_target(runs, bleu, name):
    """var-stream k=5 against fairseq's beam: speed >= 5x, BLEU within 0.3."""
    result = ratio_target(runs, "{} / fairseq beam k=5, sentences/s".format(name), ">= 5, BLEU within 0.3",
                          name, "beam-k5", lambda v: v >= 5)
    if result["value"] is not None:
        a, b = bleu.get(name), bleu.get("beam-k5")
        diff = None if a is None or b is None else round(a - b, 2)
        result["bleu_diff"] = diff
        result["detail"] = "BLEU {} vs {} ({})".format(a, b, "n/a" if diff is None else "{:+.2f}".format(diff))
        result["met"] = result["met"] and (diff is None or abs(diff) <= 0.3)
    return result


def jacobi_target(runs):
    """Jacobi against greedy: speed >= 1.3x, greedy's tokens."""
    result = ratio_target(runs, "jacobi / greedy, sentences/s", ">= 1.3, greedy's tokens", "jacobi", "greedy",
                          lambda v: v >= 1.3)
    if result["value"] is not None:
        a, b = hypotheses(runs["jacobi"].get("output")), hypotheses(runs["greedy"].get("output"))
        same = a is not None and b is not None and {i: t for i, (_, t) in a.items()} == {i: t for i, (_, t) in
                                                                                         b.items()}
        result["detail"] = "tokens {} greedy's (batches, not one sentence a call)".format(
            "equal" if same else "differ from")
        result["met"] = result["met"] and same
    return result


def targets(runs, bleu):
    """Every target from ``runs`` ({run name: gpu_probe result with decode_s, sentences, output}) and
    ``bleu`` ({run name: BLEU or None})."""
    runs = {n: r for n, r in runs.items() if r and not r.get("error") and r.get("sentences")}
    out = host_targets(runs)
    out += [beam_target(runs, bleu, name) for name in ("var-stream-graphs-k5", "var-stream-k5")]
    for stream, batch in (("var-stream-graphs-k50", "var-batch-graphs-k50"), ("var-stream-k50", "var-batch-k50")):
        out.append(ratio_target(runs, "{} / {}, sentences/s".format(stream, batch), ">= 1.15", stream, batch,
                                lambda v: v >= 1.15))
    out.append(jacobi_target(runs))
    out.append(ratio_target(runs, "4 stacked members / 1 member, time", "<= 2", "fixed-graphs-k5",
                            "fixed-graphs-1member-k5", lambda v: v <= 2, speed=False))
    out.append(ratio_target(runs, "members one after another / stacked, time", "> 1 (stacking pays)",
                            "fixed-graphs-unstacked-k5", "fixed-graphs-k5", lambda v: v > 1, speed=False))
    return out


def render(found):
    """The targets' table for summary.md."""
    lines = ["| target | goal | value | met | detail |", "| --- | --- | ---: | --- | --- |"]
    for t in found:
        met = {True: "yes", False: "**no**", None: "—"}[t["met"]]
        lines.append("| {} | {} | {} | {} | {} |".format(t["target"], t["goal"], "—" if t["value"] is None
                                                         else t["value"], met, t["detail"].replace("|", "/")))
    return lines
