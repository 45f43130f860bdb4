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


class NewstestError(RuntimeError):
    """A user-facing failure of the newstest tools; its message is one line."""
