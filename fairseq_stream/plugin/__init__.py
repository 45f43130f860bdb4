"""What the plugin registers with fairseq: the ``--generator`` and ``--search`` entries.

Each entry reads its options and hands them to :mod:`fairseq_stream.build`,
which assembles the decoder; the algorithms they name live a layer below
(:mod:`fairseq_stream.search`, :mod:`fairseq_stream.schedule`,
:mod:`fairseq_stream.jacobi`). Importing this package registers every entry
(the package's ``__init__`` does it for ``--user-dir fairseq_stream``).
"""

# Generators first, then searches: the registries list their names in this order.
from fairseq_stream.plugin import schedulers  # noqa: F401,I001  (register the entries)
from fairseq_stream.plugin import beam, fixed, greedy, jacobi, var  # noqa: F401,E402  (register the entries)
