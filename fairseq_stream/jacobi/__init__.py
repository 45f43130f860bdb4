"""Jacobi parallel decoding (Santilli et al. 2023): greedy's output in fewer sequential decoder calls.

* :mod:`.decoder`: the loop (PJ, PGJ, HGJ windows over a cached verified prefix);
* :mod:`.drafts`: what fills a window after its verified token (PAD, earlier
  iterations' guesses, an n-gram pool of the run's outputs);
* :mod:`fairseq_stream.ddgviz` (a tool on the Python API, a layer above): the decoding dependency graph of
  chosen sentences (PNG + JSON).

The multi-token decoder call is :mod:`fairseq_stream.runners.lean_window`; the
output layer is :func:`fairseq_stream.ops.topk_log_softmax`, as greedy's.
"""
