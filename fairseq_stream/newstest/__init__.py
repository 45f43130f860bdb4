"""newstest evaluations as users run them: one method per fairseq-generate run, scored by sacreBLEU.

* :mod:`.testset` finds a test set's source and reference (local plain text
  or sacreBLEU's download);
* :mod:`.prepare` tokenizes, applies the model's BPE and binarizes with the
  model's dictionaries, cached per input;
* :mod:`.run` decodes with one ``--preset`` method, detokenizes, scores and
  appends a JSON line to a results file (``scripts/newstest.sh``);
* :mod:`.table` runs the streaming paper's Table 1 grid of pairs, methods and
  beams (``scripts/newstest_all.sh``); ``scripts/report.py`` prints it.
"""

import signal
import sys


class NewstestError(RuntimeError):
    """A user-facing failure of the newstest tools; its message is one line."""


def exit_on_signals():
    """SIGTERM and SIGHUP end the tools as Ctrl-C does: through ``finally`` and cleanup, with status 128+N.

    Python's default for them is to die on the spot, which left half-prepared
    inputs behind; a SystemExit also lets ``subprocess.run`` kill its child.
    """
    def stop(signum, frame):
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
