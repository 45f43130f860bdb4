"""fairseq-stream: faster decoding for fairseq translation models, as a fairseq plugin.

Loaded by fairseq through ``--user-dir fairseq_stream`` (or the
``fairseq-stream-generate`` / ``fairseq-stream-interactive`` wrappers). Importing
the package installs the fairseq adjustments in :mod:`fairseq_stream.fairseq_glue`
and registers the ``--search`` and ``--generator`` entries.
"""

__version__ = "0.1.0"

from fairseq_stream import fairseq_glue

fairseq_glue.install()

from fairseq_stream import plugin  # noqa: E402,F401  (register the --search and --generator entries)
