"""One command-line option of ours as a field of a fairseq options dataclass.

fairseq turns each field of a registry entry's dataclass into an option
(``--search``'s and ``--generator``'s, the runners' ``--rnn-*``): its default,
and the ``help`` of the field's metadata as ``--help`` prints it. Every option
of ours is such a field and nothing more, so each is written as
``name: type = option(default, help)``.
"""

from dataclasses import field


def option(default, help: str):
    """A dataclass field for fairseq's parser: ``default``, and ``help`` as ``--help`` prints it.

    fairseq's parser does not print defaults, so a help that does not say its
    default itself gets ``(default: X)`` appended; a flag (False) and an
    unset value (None, "") say nothing: their help says what leaving them out means.
    """
    if default not in (None, False, "") and "default" not in help:
        help = "{} (default: {})".format(help, default)
    return field(default=default, metadata={"help": help})
