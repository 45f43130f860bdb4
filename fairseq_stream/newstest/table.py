"""``scripts/newstest_all.sh``: the streaming paper's Table 1 grid, then its tables and plots.

Pairs x methods x beams, each repeated ``--runs`` times through
:mod:`fairseq_stream.newstest.run` (one fairseq-generate process per run, as
the paper times them), appended to one results file, then
:mod:`fairseq_stream.newstest.report` on this run's rows (labelled with a grid
ID; the file keeps earlier runs' rows too). Searches that ignore the beam
(greedy, Jacobi) run once per pair, not once per beam. A failing cell is
reported and the grid goes on; the exit status is 1 if any cell failed.
"""

import argparse
import datetime
import os
import sys
from typing import List, Optional

from fairseq_stream.newstest import NewstestError, exit_on_signals, report, run

PROG = "newstest_all.sh"
# Yang et al. 2020, Table 1: GREEDY, FIXED (fairseq's beam search), VAR-BATCH, VAR-STREAM.
TABLE1_METHODS = ["greedy", "beam", "var-batch", "var-stream"]


def parser() -> argparse.ArgumentParser:
    """The grid's own options; every other option goes to each newstest.sh run."""
    p = argparse.ArgumentParser(
        prog=PROG, description="Run newstest.sh over pairs x methods x beams with repeats, then print the "
        "tables (scripts/report.py). Other options (e.g. --text-dir, --cpu, --limit, -- fairseq-generate "
        "options) go to every newstest.sh run.")
    p.add_argument("--pairs", nargs="+", default=["de-en", "ru-en"], metavar="PAIR")
    p.add_argument("--year", default="2018", help="default: 2018 (the paper's test set)")
    p.add_argument("--methods", nargs="+", default=TABLE1_METHODS, metavar="METHOD",
                   help="default: {} (Table 1)".format(" ".join(TABLE1_METHODS)))
    p.add_argument("--beams", nargs="+", type=int, default=[5, 50], metavar="K")
    p.add_argument("--runs", type=int, default=5, help="runs per cell (default 5, as the paper)")
    p.add_argument("--wmt19-dir", metavar="DIR",
                   help="where scripts/download_wmt19.sh unpacked the ensembles (default: $WMT19_DIR or wmt19); "
                        "each pair's model is DIR/NAME")
    p.add_argument("--text-dir-root", metavar="DIR",
                   help="local test sets: DIR/PAIR/newstestYEAR.{SRC,TGT} (as shared/data/wmt)")
    p.add_argument("--results", default="results/newstest_table1.jsonl", metavar="FILE",
                   help="JSON lines file every run's rows are appended to, labelled with this grid run's ID "
                        "(default: %(default)s)")
    p.add_argument("--report-dir", default="results/table1", metavar="DIR",
                   help="report.md and the plots of this grid run's rows, replacing an earlier report's "
                        "(default: %(default)s)")
    return p


def cells(args, passthrough: List[str]):
    """(label, newstest.sh argv) for every cell of the grid, in order."""
    for pair in args.pairs:
        common = ["--runs", str(args.runs), "--results", args.results, "--grid", args.grid]
        if args.wmt19_dir:
            common += ["--models", os.path.join(args.wmt19_dir, run.WMT19_NAMES.get(pair, pair))]
        if args.text_dir_root:
            common += ["--text-dir", os.path.join(args.text_dir_root, pair)]
        for method in args.methods:
            beams = args.beams if run.uses_beam(run.preset_search(method)) else [None]
            for k in beams:
                beam = ["--beam", str(k)] if k is not None else []
                label = "{} {}{}".format(pair, method, " k={}".format(k) if k is not None else "")
                yield label, [pair, args.year, method] + beam + common + passthrough


def _shared_problem(args, passthrough: List[str]) -> Optional[str]:
    """What is wrong with an option every cell shares (the grid's own, and --models/--limit passed through to
    each newstest.sh run), or None."""
    bad_pairs = [p for p in args.pairs if not run.PAIR.fullmatch(p)]
    if bad_pairs:
        return "--pairs {}: give SRC-TGT language codes, e.g. de-en".format(" ".join(bad_pairs))
    if args.runs < 1:
        return "--runs must be at least 1, got {}".format(args.runs)
    if any(k < 1 for k in args.beams):
        return "--beams must be at least 1, got {}".format(" ".join(map(str, args.beams)))
    if args.wmt19_dir and not os.path.isdir(args.wmt19_dir):
        return "--wmt19-dir {}: no such directory (scripts/download_wmt19.sh unpacks the ensembles)".format(
            args.wmt19_dir)
    shared = dict(zip(passthrough, passthrough[1:]))
    if "--models" in shared and not os.path.isdir(shared["--models"]):
        return "--models {}: no such directory".format(shared["--models"])
    if "--limit" in shared and not (shared["--limit"].isdigit() and int(shared["--limit"]) >= 1):
        return "--limit must be at least 1, got {}".format(shared["--limit"])
    return None


def grid_id() -> str:
    """A label for this run of the grid, unique on this host: UTC start time and process id."""
    return "{}-{}".format(datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"), os.getpid())


def main(argv: Optional[List[str]] = None):
    """Run the grid; exit 1 if any cell failed (after running the others and the report)."""
    exit_on_signals()
    args, passthrough = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    for method in args.methods:
        if method not in run.methods() and not os.path.isfile(method):
            sys.exit("{}: unknown method {!r} (choose from: {})".format(PROG, method, ", ".join(run.methods())))
    problem = _shared_problem(args, passthrough)
    if problem:  # every cell would fail alike, one line each: said once, before any runs
        sys.exit("{}: error: {}".format(PROG, problem))
    # The results file keeps every run's rows; this run's table is made of this run's rows only.
    args.grid = grid_id()
    failed = []
    for label, cell in cells(args, passthrough):
        print("{}: {}".format(PROG, label), flush=True)
        try:
            run.run(cell)
        except NewstestError as e:
            print("{}: {} failed: {}".format(PROG, label, e), file=sys.stderr, flush=True)
            failed.append(label)
    status = 0
    if os.path.exists(args.results):
        status = report.main([args.results, "--out", args.report_dir, "--grid", args.grid])
    if failed:
        sys.exit("{}: {} of the grid's cells failed: {}".format(PROG, len(failed), "; ".join(failed)))
    sys.exit(status)
