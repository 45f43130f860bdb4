"""``--preset`` against the parser: the presets' options expanded before the typed ones (typed options win).

Two things argparse alone gets wrong: a preset's repeated options make
parsing quadratic (kept: the last of each, which is what argparse would
keep), and a typed ``--search`` (or ``--generator``) replacing the preset's
leaves the preset's options of the replaced entry, which the new one does not
take, as "unrecognized arguments" (left out, and said so). The file format and
the shipped presets are :mod:`fairseq_stream.presets`; fairseq's parser and the
plugin's registries are read here, never changed.
"""

import argparse
from typing import Dict, List, Optional, Sequence, Tuple

from fairseq_stream.presets import Arity, last_of_each, split, without
from fairseq_stream.registry import (
    GENERATOR_REGISTRY, PLUGIN_GROUPS, SEARCH_REGISTRY, check_names, chosen_names, entry_actions, entry_options,
)


def resolve(parser, argv: Sequence[str]) -> Tuple[List[str], Optional[str]]:
    """(``argv`` with its ``--preset`` options expanded, a log line naming the preset options left out or None).

    Raises :class:`~fairseq_stream.presets.PresetError` for an unknown or
    unreadable preset.
    """
    preset_options, typed = split(argv)
    if preset_options is None:
        return list(argv), None
    arity = option_arity(parser)
    preset_options = last_of_each(preset_options, arity)
    kept, note = _without_replaced(preset_options, typed, arity)
    if typed and not typed[0].startswith("-"):
        # After the data directory, which fairseq-generate's command lines give first: a preset's stray word
        # or its option without a value took that directory in its place ("unrecognized arguments:
        # toy/data-bin", "argument --beam: invalid int value: 'toy/data-bin'").
        return typed[:1] + kept + typed[1:], note
    return kept + typed, note


def option_arity(parser) -> Dict[str, Arity]:
    """{option string: Arity} of the single-valued and flag options of ``parser`` and of every registry entry.

    Options that accumulate (append, count) or take several values are left
    out: collapsing their repeats would change what argparse makes of them.
    """
    plain = (argparse._StoreAction, argparse._StoreTrueAction, argparse._StoreFalseAction,
             argparse._StoreConstAction)
    arity = {}
    for action in list(entry_actions()) + list(parser._actions):
        if type(action) in plain and action.nargs in (None, 0):
            for flag in action.option_strings:
                arity[flag] = Arity(action.dest, action.nargs is None)
    return arity


def _without_replaced(preset_options, typed, arity):
    """(The preset's options less those of a search or generator that a typed option replaces, the log line).

    A typed ``--search`` replaces the preset's; the preset's generator goes
    too where the typed search does not run on it (or brings its own, as
    var-stream does). The options only the replaced entries take are left
    out, and the line says which (None where nothing is replaced).
    """
    before, after = chosen_names(preset_options), chosen_names(typed)
    if check_names(before.search, before.generator) or check_names(after.search, after.generator):
        return preset_options, None  # an unknown name: its own error follows
    search = after.search or before.search
    generator = after.generator or before.generator
    replaced = []
    if after.search and before.search and after.search != before.search:
        replaced.append(("search", before.search))
    if after.generator and before.generator and after.generator != before.generator:
        replaced.append(("generator", before.generator))
    elif after.search and before.generator and not after.generator and before.generator in GENERATOR_REGISTRY:
        entry = SEARCH_REGISTRY[after.search]
        if getattr(entry, "includes_generator", False) or before.generator not in entry.generators:
            replaced.append(("generator", before.generator))
            generator = None
    if not replaced:
        return preset_options, None
    kept = entry_options("search", search) | entry_options("generator", generator)
    flags = set().union(*(entry_options(group, name) for group, name in replaced)) - kept
    if generator is None:
        flags.add("--generator")
    preset_options, dropped = without(preset_options, flags, arity)
    note = ("fairseq-stream: the typed {} replace{} the preset's {}; left out the preset's options that only those "
            "took: {}".format(" ".join("--{} {}".format(g, getattr(after, g)) for g in PLUGIN_GROUPS if getattr(after, g)),
                              "s" if sum(bool(getattr(after, g)) for g in PLUGIN_GROUPS) == 1 else "",
                              ", ".join("--{} {}".format(g, n) for g, n in replaced), " ".join(dropped) or "none"))
    return preset_options, note
