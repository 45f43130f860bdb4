"""``scripts/report.py``: newstest results files to markdown tables and plots.

A formatting tool, so its input here is fixed rows in the newstest scripts'
schema. Checked: means, standard deviations and speedups in the tables,
method order, a missing baseline, BLEU that differs between runs, greedy rows
in every beam's table, the PNG plots, and one-line errors for bad lines.
The command line (the ``scripts/report.py`` shim) runs once as a subprocess; the rest imports
:mod:`fairseq_stream.newstest.report`.
"""

import json

import pytest

from conftest import REPO, run_tool

SCRIPT = REPO / "scripts" / "report.py"
GPU = "cuda: NVIDIA H100 80GB HBM3"
SIGNATURE = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"


@pytest.fixture(scope="module")
def report():
    from fairseq_stream.newstest import report as module

    return module


def row(method, decode_s, bleu=41.0, pair="de-en", beam=50, device=GPU, run=1, counters=None, wall_s=None):
    return {
        "pair": pair, "testset": "newstest2018", "method": method, "beam": beam, "bleu": bleu,
        "bleu_signature": SIGNATURE, "sentences": 2998, "wall_s": wall_s if wall_s is not None else decode_s + 10,
        "decode_s": decode_s, "counters": counters, "device": device, "preset": [method],
        "generate_args": ["--beam", str(beam)], "models": ["model1.pt"], "host": "h",
        "date": "2026-11-23T09:00:00+00:00", "run": run,
    }


ROWS = [
    # de-en at beam 50: every method listed out of order, runs interleaved.
    row("var-stream", 100.0, run=1, counters={"timesteps": 10, "expansions": 400, "expansions_per_step": 40.0,
                                               "refills": 3}),
    row("beam", 300.0, run=1),
    row("var-stream", 110.0, run=2, counters={"timesteps": 10, "expansions": 440, "expansions_per_step": 44.0,
                                               "refills": 3}),
    row("beam", 320.0, run=2),
    row("zeta-search", 150.0),
    row("fixed", 250.0, counters={"timesteps": 10, "expansions": 500}),  # no expansions_per_step: computed
    row("greedy", 30.0, bleu=39.5, beam=None),
    row("alpha-search", 200.0),
    # ru-en at beam 50: no baseline row, and a BLEU that differs between runs.
    row("var-stream", 90.0, bleu=38.1, pair="ru-en", run=1),
    row("var-stream", 90.0, bleu=38.3, pair="ru-en", run=2),
    # beam 5 on the same GPU, and a CPU run.
    row("beam", 40.0, beam=5),
    row("var-stream", 20.0, beam=5),
    row("beam", 500.0, beam=5, device="cpu"),
]


def write_results(path, rows, blank_lines=True):
    lines = [json.dumps(r) for r in rows]
    if blank_lines:
        lines.insert(2, "")
        lines.append("   ")
    path.write_text("\n".join(lines) + "\n")
    return path


def table_rows(markdown, title):
    """{(pair, method): [cells]} of the table under ``### title``."""
    section = markdown.split("### " + title + "\n", 1)[1].split("### ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("pair", "---"):
            out[(cells[0], cells[2])] = cells
    return out


def tables(report, rows, baseline="beam"):
    return report.markdown(report.build_tables(report.group_runs(rows), baseline), baseline)


def test_means_std_speedup_and_counters(report):
    md = tables(report, ROWS)
    t = table_rows(md, GPU + ", beam 50")
    # cells: pair, test set, method, BLEU, decode s, n, process s, speedup, expansions/step
    assert t[("de-en", "beam")][3:] == ["41.00", "310.00 ± 14.14", "2", "320.00", "1.00×", "—"]
    assert t[("de-en", "var-stream")][3:] == ["41.00", "105.00 ± 7.07", "2", "115.00", "2.95×", "42.0"]
    assert t[("de-en", "fixed")][4:] == ["250.00 ± 0.00", "1", "260.00", "1.24×", "50.0"]
    assert t[("de-en", "greedy")][3:] == ["39.50", "30.00 ± 0.00", "1", "40.00", "10.33×", "—"]


def test_method_order_and_tables(report):
    md = tables(report, ROWS)
    titles = [line[4:] for line in md.splitlines() if line.startswith("### ")]
    assert titles == ["cpu, beam 5", GPU + ", beam 5", GPU + ", beam 50"]
    t = table_rows(md, GPU + ", beam 50")
    assert list(t) == [("de-en", m) for m in ("greedy", "beam", "fixed", "var-stream", "alpha-search", "zeta-search")] \
        + [("ru-en", "var-stream")]
    # Greedy does not depend on the beam: it is in the beam-5 table too, against that baseline.
    t5 = table_rows(md, GPU + ", beam 5")
    assert list(t5) == [("de-en", "greedy"), ("de-en", "beam"), ("de-en", "var-stream")]
    assert t5[("de-en", "greedy")][7] == "1.33×" and t5[("de-en", "var-stream")][7] == "2.00×"
    assert "BLEU signature: `{}`".format(SIGNATURE) in md


def test_missing_baseline_and_differing_bleu(report):
    md = tables(report, ROWS)
    ru = table_rows(md, GPU + ", beam 50")[("ru-en", "var-stream")]
    assert ru[7] == "—"
    assert ru[3] == "38.20 ⚠ (38.10–38.30)"
    assert "⚠ BLEU differs between runs of a deterministic decoder: ru-en newstest2018 var-stream." in md
    assert md.count("⚠ BLEU differs") == 1


def test_other_baseline(report):
    t = table_rows(tables(report, ROWS, baseline="var-stream"), GPU + ", beam 50")
    assert t[("de-en", "beam")][7] == "0.34×" and t[("de-en", "var-stream")][7] == "1.00×"
    assert t[("ru-en", "var-stream")][7] == "1.00×"


def test_nulls_show_dashes(report):
    md = tables(report, [row("beam", 10.0, bleu=None, beam=None, device=None)])
    cells = table_rows(md, "unknown device, beam —")[("de-en", "beam")]
    assert cells[3] == "—" and cells[7] == "1.00×"


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({"pair": "de-en", "testset": "t"}), "missing method"),
    (json.dumps(dict(row("beam", 1.0), decode_s="12s")), "decode_s must be a number or null"),
])
def test_malformed_line_is_named(report, tmp_path, line, message):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row("beam", 1.0)) + "\n\n" + line + "\n")
    with pytest.raises(report.ReportError) as err:
        report.read_rows([str(path)])
    assert str(err.value).startswith("{}:3: {}".format(path, message))
    assert "\n" not in str(err.value)


def test_a_line_that_is_not_utf8_is_named(report, tmp_path, capsys):
    """Not a UnicodeDecodeError traceback: one line naming the file, line and byte; exit status 1."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(row("beam", 1.0)).encode() + b"\n" + json.dumps(row("fixed", 1.0)).encode("utf-8")
                     .replace(b"fixed", b"fix\xe9d") + b"\n")
    with pytest.raises(report.ReportError) as err:
        report.read_rows([str(path)])
    assert str(err.value).startswith("{}:2: not UTF-8 text (byte 0xe9 at byte offset ".format(path))
    capsys.readouterr()
    assert report.main([str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("report.py: error: {}:2: not UTF-8".format(path)) and err.count("\n") == 1


def test_grid_selects_one_grid_runs_rows(report, tmp_path, capsys):
    """newstest_all.sh appends every run to one file; its report holds only its own rows (no mixing)."""
    first = [dict(row("beam", 300.0), grid="g1"), dict(row("var-stream", 100.0), grid="g1")]
    second = [dict(row("beam", 200.0), grid="g2"), dict(row("fixed", 150.0), grid="g2")]
    path = write_results(tmp_path / "r.jsonl", [row("greedy", 30.0, beam=None)] + first + second)
    capsys.readouterr()
    for grid in ("g2", "last"):
        assert report.main([str(path), "--grid", grid]) == 0
        t = table_rows(capsys.readouterr().out, GPU + ", beam 50")
        assert list(t) == [("de-en", "beam"), ("de-en", "fixed")]
        assert t[("de-en", "beam")][4:6] == ["200.00 ± 0.00", "1"]
    assert report.main([str(path), "--grid", "g3"]) == 1
    assert capsys.readouterr().err == "report.py: error: --grid g3: no row of that grid run\n"
    assert report.main([str(path)]) == 0  # without --grid: every row, as before
    assert table_rows(capsys.readouterr().out, GPU + ", beam 50")[("de-en", "beam")][5] == "2"


def test_out_dir_keeps_no_plot_of_an_earlier_report(report, tmp_path):
    out = tmp_path / "out"
    report.write_outputs(report.build_tables(report.group_runs(ROWS), "beam"), "beam", str(out))
    assert len(list(out.glob("*.png"))) == 6
    (out / "notes.png").write_bytes(b"not ours")
    report.write_outputs(report.build_tables(report.group_runs([row("beam", 500.0, beam=5, device="cpu")]), "beam"),
                         "beam", str(out))
    assert sorted(p.name for p in out.glob("*.png")) == ["bleu_vs_decode_cpu_beam5.png", "decode_cpu_beam5.png",
                                                        "notes.png"]


def test_command_line_writes_tables_and_plots(tmp_path, report, capsys):
    a = write_results(tmp_path / "a.jsonl", ROWS[:8])
    b = write_results(tmp_path / "b.jsonl", ROWS[8:])
    out = tmp_path / "out"
    proc = run_tool(["python", SCRIPT, a, b, "--out", out])
    assert (out / "report.md").read_text() == proc.stdout
    assert "| de-en | newstest2018 | var-stream | 41.00 | 105.00 ± 7.07 | 2 | 115.00 | 2.95× | 42.0 |" in proc.stdout
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted("{}_{}.png".format(kind, slug) for kind in ("decode", "bleu_vs_decode")
                          for slug in ("cpu_beam5", "cuda-nvidia-h100-80gb-hbm3_beam5",
                                       "cuda-nvidia-h100-80gb-hbm3_beam50"))
    for name in pngs:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    # In this process (the subprocess above already shows the script's exit path): status 1, one line.
    capsys.readouterr()
    assert report.main([str(a), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("report.py: error: {}:2: not valid JSON".format(bad))
    assert len(err.strip().splitlines()) == 1


def test_a_baseline_given_that_no_row_has_is_one_line(report, tmp_path, capsys):
    """A typo in --baseline made a speedup column of dashes, status 0."""
    path = write_results(tmp_path / "r.jsonl", [row("beam", 300.0), row("var-stream", 100.0)])
    capsys.readouterr()
    assert report.main([str(path), "--baseline", "nosuch"]) == 1
    assert capsys.readouterr().err == ("report.py: error: --baseline nosuch: no run of that method in the results "
                                       "(methods: beam, var-stream)\n")
    only_ours = write_results(tmp_path / "ours.jsonl", [row("var-stream", 100.0)])
    assert report.main([str(only_ours)]) == 0  # the default baseline may be absent: its column shows dashes
