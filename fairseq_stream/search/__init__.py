"""Search policies (``--search``): which candidates survive each step."""

from fairseq_stream.search import beam  # noqa: F401  (registers the entry)
