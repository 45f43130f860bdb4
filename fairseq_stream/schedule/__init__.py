"""Schedulers (``--generator``): which sentences are decoded together, and when."""

from fairseq_stream.schedule import batch  # noqa: F401  (registers the entry)
