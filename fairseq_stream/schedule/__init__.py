"""Schedulers (``--generator``): which sentences are decoded together, and when."""

from fairseq_stream.schedule import batch, stream, topup  # noqa: F401  (register the entries)
