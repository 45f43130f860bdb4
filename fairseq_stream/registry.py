"""The two fairseq registries this plugin adds: ``--search`` and ``--generator``.

``--search`` picks the search policy (which candidates survive), ``--generator``
the scheduler (which sentences are decoded together, and when). Entries are
registered with a ``FairseqDataclass`` of their own options, so fairseq shows
them in ``--help`` and carries them through its Hydra config as ``cfg.search``
and ``cfg.generator``. Both default to None: without them fairseq behaves
exactly as it does without the plugin.
"""

from fairseq.registry import setup_registry

(
    build_search_entry,
    register_search,
    SEARCH_REGISTRY,
    SEARCH_DATACLASS_REGISTRY,
) = setup_registry("--search", default=None)

(
    build_generator_entry,
    register_generator,
    GENERATOR_REGISTRY,
    GENERATOR_DATACLASS_REGISTRY,
) = setup_registry("--generator", default=None)
