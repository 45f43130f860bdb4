"""Search policies (``--search``): which candidates survive each step."""

from fairseq_stream.search import beam, fixed, greedy, jacobi, var  # noqa: F401  (register entries)
