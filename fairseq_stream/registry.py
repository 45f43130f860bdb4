"""The two fairseq registries this plugin adds: ``--search`` and ``--generator``.

``--search`` picks the search policy (which candidates survive), ``--generator``
the scheduler (which sentences are decoded together, and when). Entries are
registered with a ``FairseqDataclass`` of their own options, so fairseq shows
them in ``--help`` and carries them through its Hydra config as ``cfg.search``
and ``cfg.generator``. Both default to None: without them fairseq behaves
exactly as it does without the plugin.

Below the registries, what the command line's checks ask of them: whether a
name is known (:func:`check_names`), which names a command line chose
(:func:`chosen_names`) and which options an entry takes (:func:`entry_options`).
"""

import functools

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

PLUGIN_GROUPS = ("search", "generator")


def check_names(search, generator):
    """A one-line error naming an unknown ``--search`` or ``--generator`` and the valid names, else None."""
    for group, name, registry in (("search", search, SEARCH_REGISTRY), ("generator", generator, GENERATOR_REGISTRY)):
        if name is not None and name not in registry:
            return "unknown --{} {} (choose from: {})".format(group, name, ", ".join(registry))
    return None


def chosen_names(argv):
    """The raw ``--search``/``--generator`` names of the command line ``argv`` (None where absent)."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for group in PLUGIN_GROUPS:
        pre.add_argument("--" + group)
    chosen, _ = pre.parse_known_args(argv)
    return chosen


@functools.lru_cache(maxsize=None)
def entry_parser(group, name):
    """A parser holding only the options of registry entry ``--group name`` (empty for an unknown one)."""
    import argparse

    from fairseq.dataclass.utils import gen_parser_from_dataclass
    from fairseq.registry import REGISTRIES

    parser = argparse.ArgumentParser(add_help=False)
    dataclass = REGISTRIES[group]["dataclass_registry"].get(name)
    if dataclass is not None:
        gen_parser_from_dataclass(parser, dataclass())
    return parser


def entry_actions():
    """The argparse actions of every entry of both registries."""
    from fairseq.registry import REGISTRIES

    for group in PLUGIN_GROUPS:
        for name in REGISTRIES[group]["dataclass_registry"]:
            yield from entry_parser(group, name)._actions


def entry_options(group, name):
    """The option strings ``--group name`` takes (none for None or an unknown name)."""
    if name is None:
        return set()
    return {flag for action in entry_parser(group, name)._actions for flag in action.option_strings}
