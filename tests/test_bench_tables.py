"""The documentation's tables of figures equal what scripts/render_bench_tables.py renders from docs/bench/.

Every table of measured figures in README.md and docs/*.md sits between
``<!-- BEGIN bench:NAME ... -->`` and ``<!-- END bench:NAME -->`` markers and is
rendered from the raw JSON results in docs/bench/ (with the command, commit,
machine and date docs/bench/index.json records). If a test here fails, run
``python scripts/render_bench_tables.py`` and commit what it changes, or fix the
raw result or its index entry.
"""

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_bench_tables", REPO / "scripts" / "render_bench_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _renderer()


def test_committed_tables_equal_the_rendered_ones():
    stale = [os.path.relpath(doc, REPO) for doc, (old, new) in render.render_all().items() if old != new]
    assert not stale, "stale benchmark tables in {}: run python scripts/render_bench_tables.py".format(stale)


def test_every_table_is_used_and_every_block_names_a_table():
    used = set()
    for doc in render.documents():
        text = Path(doc).read_text(encoding="utf-8")
        begins = re.findall(r"<!-- BEGIN bench:([a-z0-9-]+)", text)
        ends = re.findall(r"<!-- END bench:([a-z0-9-]+) -->", text)
        assert sorted(begins) == sorted(ends), "{}: unmatched bench markers".format(doc)
        used.update(begins)
    assert used <= set(render.TABLES), "unknown tables: {}".format(used - set(render.TABLES))
    assert set(render.TABLES) <= used, "tables no document shows: {}".format(set(render.TABLES) - used)


def test_every_indexed_result_exists_and_says_where_it_came_from():
    index = json.loads((REPO / "docs" / "bench" / "index.json").read_text())
    for key, entry in index["results"].items():
        for name in entry["files"]:
            assert (REPO / "docs" / "bench" / name).is_file(), "{}: {} is missing".format(key, name)
        for field in ("command", "machine", "date", "model", "input"):
            assert entry.get(field), "{}: no {}".format(key, field)
        assert "commit" in entry, "{}: say commit null where the run did not record it".format(key)
        assert entry["machine"] in index["machines"] and entry["model"] in index["models"], key


def test_a_changed_raw_result_changes_the_table(tmp_path):
    """The tables really come from the files: a different figure in a raw file renders a different table."""
    bench = tmp_path / "bench"
    bench.mkdir()
    for f in (REPO / "docs" / "bench").iterdir():
        (bench / f.name).write_bytes(f.read_bytes())
    data = json.loads((bench / "stream_cpu_k50.json").read_text())
    for row in data["rows"]:
        if row["method"] == "var-batch":
            row["wall_s"] = 8.22
    (bench / "stream_cpu_k50.json").write_text(json.dumps(data))
    readme = str(REPO / "README.md")
    before = "\n".join(render.table_what_you_get(render.Results(), readme))
    after = "\n".join(render.table_what_you_get(render.Results(str(bench)), readme))
    assert "16.74×" in before and "8.37×" in after


@pytest.mark.parametrize("doc", [d for d in render.documents() if not d.endswith(("HISTORY.md", "GPU.md"))],
                         ids=lambda d: os.path.relpath(d, REPO))
def test_no_document_cites_run_numbers(doc):
    """Figures are cited by their raw result, not by 'run 5' or 'runs 9-12' (docs/HISTORY.md keeps the run log)."""
    text = Path(doc).read_text(encoding="utf-8")
    text = re.sub(r"`[^`\n]*`|\([^()\s]*\.jsonl?\)", "", text)  # file names and commands (--runs 5) are not citations
    hits = re.findall(r"(?i)(?<![-\w])runs? \d+", text)
    assert not hits, "{} cites run numbers: {}".format(os.path.relpath(doc, REPO), hits)
