"""Summarize newstest results files as markdown tables and plots.

    python scripts/report.py RESULTS.jsonl [MORE.jsonl ...] [--out DIR] [--baseline beam] [--grid ID|last]

Each results file holds one JSON object per line, one line per run, as the
newstest scripts append them (fields: pair, testset, method, beam, bleu,
bleu_signature, decode_s, wall_s, counters, device, ...). Rows are grouped by
(pair, testset, beam, device, method) and printed in the layout of Yang et
al. 2020's Table 1: one table per (device, beam), one row per pair and
method, with

* BLEU: the mean over runs. Decoding is deterministic, so runs that differ in
  BLEU are flagged (the range is shown) rather than averaged silently.
* decode s: fairseq-generate's own "Translated N sentences ... in X s"
  (decoding only), mean ± standard deviation over the n runs (0 for one run).
* process s: the whole process's wall clock, mean over runs.
* speedup: the --baseline method's mean decode seconds (same pair, test set,
  beam and device) over this row's; "—" when there is no baseline row.
* expansions/step: the search's counters, mean over runs; "—" without them.

Greedy rows (method greedy, or a null beam) do not depend on the beam, so
they appear in every table of their device, their speedup taken against that
table's baseline.

With --out DIR the tables also go to DIR/report.md, and per table two PNG
plots: decode seconds per method and pair (bars, standard deviation as error
bars) and BLEU against decode seconds (one point per method and pair). The
plots of an earlier report in DIR whose tables are not in this one are removed.

Results files keep every run appended to them. ``scripts/newstest_all.sh``
labels the rows of each of its runs with a grid ID and reports that run's rows
only; ``--grid ID`` does the same by hand, ``--grid last`` picks the grid of
the last labelled row.
"""

import argparse
import glob
import json
import logging
import os
import re
import statistics
import sys
from collections import OrderedDict

# Table 1's order: the cheap reference, fairseq's baseline, then our searches
# from the plainest to the most scheduled. Unknown methods follow, sorted.
METHOD_ORDER = ["greedy", "beam", "fixed", "fixed-stream", "var-batch", "var-stream", "var-fifo",
                "topup", "jacobi"]
REQUIRED = ("pair", "testset", "method")
DASH = "—"
FLAG = "⚠"
MARKERS = "os^Dv<>p*h"


class ReportError(Exception):
    """A problem with the input, reported as one line."""


def read_rows(paths):
    """Every run (a dict) of the given results files, in file order; blank lines skipped."""
    rows = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ReportError("cannot read {}: {}".format(path, e.strerror or e))
        # Decoded line by line, so that bytes that are not UTF-8 are reported with their line.
        for number, raw in enumerate(data.splitlines(), 1):
            where = "{}:{}".format(path, number)
            line = decode_line(raw, where)
            if line.strip():
                rows.append(parse_row(line, where))
    return rows


def decode_line(raw, where):
    """One line of a results file as text; a ReportError naming ``where`` if it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportError("{}: not UTF-8 text (byte 0x{:02x} at byte offset {} of the line); results files are "
                          "written in UTF-8".format(where, raw[e.start], e.start))


def parse_row(line, where):
    """One results line as a dict; a ReportError naming ``where`` if it is not a usable row."""
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ReportError("{}: not valid JSON ({})".format(where, e))
    if not isinstance(row, dict):
        raise ReportError("{}: expected a JSON object, got {}".format(where, type(row).__name__))
    missing = [key for key in REQUIRED if not row.get(key)]
    if missing:
        raise ReportError("{}: missing {}".format(where, ", ".join(missing)))
    for key in ("beam", "bleu", "decode_s", "wall_s"):
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ReportError("{}: {} must be a number or null, got {!r}".format(where, key, value))
    if row.get("counters") is not None and not isinstance(row["counters"], dict):
        raise ReportError("{}: counters must be an object or null".format(where))
    return row


def beam_of(row):
    """The row's beam; None for beam-independent runs (greedy ignores --beam)."""
    if row["method"] == "greedy" or row.get("beam") is None:
        return None
    return int(row["beam"])


def group_runs(rows):
    """{(pair, testset, beam, device, method): [rows]} in first-seen order."""
    groups = OrderedDict()
    for row in rows:
        key = (row["pair"], row["testset"], beam_of(row), row.get("device") or "unknown device", row["method"])
        groups.setdefault(key, []).append(row)
    return groups


def mean_std(values):
    """(mean, standard deviation) of the non-null values, std 0 for one; (None, None) for none."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def expansions_per_step(row):
    """The run's expansions per decoding step, from its counters; None without them."""
    counters = row.get("counters") or {}
    if counters.get("expansions_per_step") is not None:
        return float(counters["expansions_per_step"])
    if counters.get("expansions") is not None and counters.get("timesteps"):
        return counters["expansions"] / counters["timesteps"]
    return None


def summarize(runs):
    """The numbers one table row shows, from the runs of one group."""
    bleus = [r["bleu"] for r in runs if r.get("bleu") is not None]
    decode, decode_std = mean_std([r.get("decode_s") for r in runs])
    return {
        "n": len(runs),
        "bleu": statistics.mean(bleus) if bleus else None,
        "bleu_range": (min(bleus), max(bleus)) if bleus else None,
        "bleu_differs": len(set(bleus)) > 1,
        "decode": decode,
        "decode_std": decode_std,
        "wall": mean_std([r.get("wall_s") for r in runs])[0],
        "eps": mean_std([expansions_per_step(r) for r in runs])[0],
        "signatures": sorted({r["bleu_signature"] for r in runs if r.get("bleu_signature")}),
    }


def method_rank(method):
    """Sort key: the fixed order first, then other methods alphabetically."""
    if method in METHOD_ORDER:
        return (0, METHOD_ORDER.index(method), "")
    return (1, 0, method)


def build_tables(groups, baseline):
    """[((device, beam), [row dicts])] sorted by device then beam; each row has a speedup.

    Beam-independent groups join every beam's table of their device; on their
    own (no beam table for that device) they make a table with beam None.
    """
    summaries = {key: summarize(runs) for key, runs in groups.items()}
    beams = OrderedDict()
    for (_, _, beam, device, _) in summaries:
        beams.setdefault(device, set())
        if beam is not None:
            beams[device].add(beam)
    tables = []
    for device in sorted(beams):
        for beam in sorted(beams[device]) or [None]:
            rows = []
            for (pair, testset, row_beam, row_device, method), s in summaries.items():
                if row_device != device or row_beam not in (beam, None):
                    continue
                base = summaries.get((pair, testset, beam, device, baseline))
                speedup = None
                if base and base["decode"] and s["decode"]:
                    speedup = base["decode"] / s["decode"]
                rows.append(dict(s, pair=pair, testset=testset, method=method, speedup=speedup))
            rows.sort(key=lambda r: (r["pair"], r["testset"], method_rank(r["method"])))
            tables.append(((device, beam), rows))
    return tables


def fmt(value, spec, suffix=""):
    """``value`` formatted, or the dash for a missing one."""
    return DASH if value is None else format(value, spec) + suffix


def fmt_bleu(row):
    """Mean BLEU; with the range and a flag when the runs disagree."""
    if row["bleu"] is None:
        return DASH
    if row["bleu_differs"]:
        low, high = row["bleu_range"]
        return "{:.2f} {} ({:.2f}–{:.2f})".format(row["bleu"], FLAG, low, high)
    return "{:.2f}".format(row["bleu"])


def fmt_decode(row):
    """Mean ± std decode seconds."""
    if row["decode"] is None:
        return DASH
    return "{:.2f} ± {:.2f}".format(row["decode"], row["decode_std"])


def table_title(device, beam):
    """The heading of one table."""
    return "{}, beam {}".format(device, DASH if beam is None else beam)


def markdown_table(device, beam, rows, baseline):
    """One table as markdown lines, with notes on flagged BLEU and the BLEU signatures."""
    lines = [
        "### " + table_title(device, beam),
        "",
        "| pair | test set | method | BLEU | decode s (mean ± std) | n | process s | speedup vs {} | expansions/step |"
        .format(baseline),
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["pair"], r["testset"], r["method"], fmt_bleu(r), fmt_decode(r), r["n"],
            fmt(r["wall"], ".2f"), fmt(r["speedup"], ".2f", "×"), fmt(r["eps"], ".1f")))
    lines.append("")
    flagged = ["{} {} {}".format(r["pair"], r["testset"], r["method"]) for r in rows if r["bleu_differs"]]
    if flagged:
        lines.append("{} BLEU differs between runs of a deterministic decoder: {}.".format(FLAG, "; ".join(flagged)))
        lines.append("")
    signatures = sorted({sig for r in rows for sig in r["signatures"]})
    if signatures:
        lines.append("BLEU signature{}: {}".format(
            "s" if len(signatures) > 1 else "", "; ".join("`{}`".format(s) for s in signatures)))
        lines.append("")
    return lines


def markdown(tables, baseline):
    """Every table, as one markdown text."""
    lines = []
    for (device, beam), rows in tables:
        lines += markdown_table(device, beam, rows, baseline)
    return "\n".join(lines)


def slug(device, beam):
    """A file-name part for one (device, beam) table."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower() or "device"
    return "{}_beam{}".format(name, "-" if beam is None else beam)


def row_label(row, rows):
    """The pair, with the test set when the table holds more than one test set."""
    if len({r["testset"] for r in rows}) > 1:
        return "{} {}".format(row["pair"], row["testset"])
    return row["pair"]


def methods_of(rows):
    """The table's methods in display order."""
    return sorted({r["method"] for r in rows}, key=method_rank)


def labels_of(rows):
    """The table's row labels (:func:`row_label`), in first-seen order: a plot's x ticks or markers."""
    return list(OrderedDict.fromkeys(row_label(r, rows) for r in rows))


def colour(i):
    """matplotlib's i-th default colour, so a method looks the same in both plots."""
    return "C{}".format(i % 10)


def finish_plot(plt, fig, ax, what, device, beam, path):
    """Title a plot ``what`` for its table, put its legend outside the axes and write it to ``path``."""
    ax.set_title(what + "\n" + table_title(device, beam), fontsize="medium")
    # Outside the axes: inside, it covers the tallest bars.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def plot_decode_bars(plt, device, beam, rows, path):
    """Grouped bars: decode seconds of each method, grouped by pair, std as error bars."""
    labels = labels_of(rows)
    methods = methods_of(rows)
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 0.35 * len(labels) * len(methods)), 4))
    for i, method in enumerate(methods):
        by_label = {row_label(r, rows): r for r in rows if r["method"] == method and r["decode"] is not None}
        xs = [j + (i - (len(methods) - 1) / 2) * width for j, label in enumerate(labels) if label in by_label]
        ys = [by_label[label]["decode"] for label in labels if label in by_label]
        errs = [by_label[label]["decode_std"] for label in labels if label in by_label]
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=method, color=colour(i))
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("decode seconds (mean ± std)")
    finish_plot(plt, fig, ax, "decode time", device, beam, path)


def plot_bleu_vs_time(plt, device, beam, rows, path):
    """Scatter of BLEU against decode seconds, one point per method and pair, labelled."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    methods = methods_of(rows)
    labels = labels_of(rows)
    several = len(labels) > 1
    for r in rows:
        if r["bleu"] is None or r["decode"] is None:
            continue
        # The bar chart's colour per method; a marker per pair.
        # A legend, not annotations: methods with equal output (fixed and beam) share a point.
        label = r["method"] + (" ({})".format(row_label(r, rows)) if several else "")
        ax.scatter(r["decode"], r["bleu"], color=colour(methods.index(r["method"])),
                   marker=MARKERS[labels.index(row_label(r, rows)) % len(MARKERS)], label=label, alpha=0.8)
    ax.set_xlabel("decode seconds (mean)")
    ax.set_ylabel("BLEU")
    finish_plot(plt, fig, ax, "BLEU vs decode time", device, beam, path)


def write_outputs(tables, baseline, out):
    """DIR/report.md and the two plots per table; the paths written."""
    # fairseq's import sets the root logger to DEBUG; matplotlib's start-up and font search are not our output.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib
    except ImportError:
        raise ReportError("--out needs matplotlib for the plots (pip install matplotlib)")
    matplotlib.use("Agg")  # files only, no display on servers
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    stale = set(glob.glob(os.path.join(out, "decode_*.png")) + glob.glob(os.path.join(out, "bleu_vs_decode_*.png")))
    written = [os.path.join(out, "report.md")]
    with open(written[0], "w", encoding="utf-8") as f:
        f.write(markdown(tables, baseline))
    for (device, beam), rows in tables:
        bars = os.path.join(out, "decode_{}.png".format(slug(device, beam)))
        scatter = os.path.join(out, "bleu_vs_decode_{}.png".format(slug(device, beam)))
        plot_decode_bars(plt, device, beam, rows, bars)
        plot_bleu_vs_time(plt, device, beam, rows, scatter)
        written += [bars, scatter]
    # A plot of a table this report does not have (an earlier run's beam or device) would pass for this run's.
    for path in stale - set(written):
        os.remove(path)
    return written


def select_grid(rows, grid):
    """The rows of one grid run (``grid`` an ID, or "last": the last labelled row's); a ReportError if none."""
    if grid == "last":
        labelled = [r["grid"] for r in rows if r.get("grid")]
        if not labelled:
            raise ReportError("--grid last: no row has a grid ID (rows of newstest_all.sh runs have one)")
        grid = labelled[-1]
    chosen = [r for r in rows if r.get("grid") == grid]
    if not chosen:
        raise ReportError("--grid {}: no row of that grid run".format(grid))
    return chosen


def main(argv=None):
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="report.py", description=__doc__.split("\n\n")[0],
                                     epilog="The columns are described in fairseq_stream/newstest/report.py.")
    parser.add_argument("results", nargs="+", metavar="RESULTS.jsonl", help="results files (JSON lines)")
    parser.add_argument("--out", metavar="DIR", help="also write DIR/report.md and PNG plots")
    parser.add_argument("--baseline", metavar="METHOD",
                        help="method the speedups are measured against (default: beam)")
    parser.add_argument("--grid", metavar="ID|last",
                        help="only the rows of this newstest_all.sh run (its ID, or last: the latest run's); "
                             "default: every row")
    args = parser.parse_args(argv)
    try:
        rows = read_rows(args.results)
        if not rows:
            raise ReportError("no results in {}".format(", ".join(args.results)))
        if args.grid:
            rows = select_grid(rows, args.grid)
        methods = sorted({row["method"] for row in rows})
        if args.baseline is not None and args.baseline not in methods:  # a column of dashes and status 0
            raise ReportError("--baseline {}: no run of that method in the results (methods: {})".format(
                args.baseline, ", ".join(methods)))
        args.baseline = args.baseline or "beam"  # without beam runs: dashes, as the columns' notes say
        tables = build_tables(group_runs(rows), args.baseline)
        print(markdown(tables, args.baseline), end="")
        if args.out:
            written = write_outputs(tables, args.baseline, args.out)
            sys.stderr.write("report.py: wrote {} and {} plots\n".format(written[0], len(written) - 1))
    except ReportError as e:
        sys.stderr.write("report.py: error: {}\n".format(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
