"""The package's Python functions stay short: none longer than 60 lines, so each reads as one step.

A function's length runs from its ``def`` line to the last line of its body
(docstring and nested functions included; decorators not). A longer one is
split into named steps. Compiled kernels (``ops/csrc``) are C++ and not
counted. The source is read, not imported.
"""

import ast

from conftest import REPO

PACKAGE = REPO / "fairseq_stream"
MAX_LINES = 60


def long_functions(path, limit=MAX_LINES):
    """``(name, first line, lines)`` of each function or method of ``path`` longer than ``limit`` lines."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                out.append((node.name, node.lineno, lines))
    return out


def test_no_function_is_longer_than_60_lines():
    found = ["{}:{} {} ({} lines)".format(path.relative_to(REPO), line, name, lines)
             for path in sorted(PACKAGE.rglob("*.py")) for name, line, lines in long_functions(path)]
    assert found == [], "split these into named steps: {}".format(found)


def test_the_reader_counts_from_the_def_line_to_the_end_of_the_body(tmp_path):
    source = tmp_path / "sample.py"
    body = "\n".join("    x = {}".format(i) for i in range(MAX_LINES - 1))
    source.write_text("@staticmethod\ndef fits():\n{}\n\n\ndef too_long():\n{}\n    return x\n".format(body, body))
    assert long_functions(source) == [("too_long", MAX_LINES + 4, MAX_LINES + 1)]
