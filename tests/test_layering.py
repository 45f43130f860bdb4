"""The package's import graph: no circle, and no module importing from a layer above its own.

Layers, lowest first: shared basics; compiled ops; model runners; what
decodes (the engine's loop, the decoder, the search policies in search/, the schedulers in
schedule/, Jacobi's loop in jacobi/); what assembles a decoder and registers
it with fairseq (build.py, plugin/: the --search and --generator entries);
what users call (fairseq glue, API, CLI, bulk, newstest, ddgviz). A folder
sits at one layer: no module overrides its folder's. Every module must have
a layer here: a new one is placed on purpose. The graph is read from the
source (module-level and function-level imports alike), not by importing it.
"""

import ast

import pytest

from conftest import REPO

PACKAGE = REPO / "fairseq_stream"
# Longest matching prefix wins; a folder's modules take the folder's layer.
LAYERS = {
    "errors": 0, "stats": 0, "registry": 0, "inference_mode": 0, "host_sync": 0, "state_merge": 0,
    "text_input": 0, "checkpoint": 0, "cohort": 0, "presets": 0, "cpu_info": 0, "malloc_policy": 0,
    "exit_threads": 0, "hypotheses": 0, "option_field": 0, "interrupt": 0, "token_strings": 0,
    "parent_death": 0,
    "ops": 1,
    "runners": 2,
    "engine": 3, "decoder": 3, "decoder_parts": 3, "candidates": 3, "cohort_steps": 3, "lengths": 3,
    "compiled_search": 3, "finalize": 3, "late_reads": 3, "output_choice": 3, "search": 3, "schedule": 3, "jacobi": 3,
    "build": 4, "option_types": 4, "plugin": 4,
    "": 5, "fairseq_glue": 5, "api": 5, "cli": 5, "bulk": 5, "newstest": 5, "ddgviz": 5,
}


def modules():
    """{dotted name relative to the package ('' for the package itself): path}."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name, path, known):
    """The package's modules that ``name`` imports (``from pkg import sub`` imports ``sub``, not ``pkg``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = ("fairseq_stream." + package).strip(".").split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            subs = [base + "." + a.name for a in node.names]
            targets = [t for t in subs if t[len("fairseq_stream."):] in known] or [base]
        else:
            continue
        for target in targets:
            if target != "fairseq_stream" and not target.startswith("fairseq_stream."):
                continue
            module = target[len("fairseq_stream."):] if "." in target else ""
            while module not in known:
                module = module.rpartition(".")[0]
            if module != name:
                found.add(module)
    return found


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name):
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + ".") or prefix == "":
            return LAYERS[prefix]


def test_every_import_goes_to_the_same_layer_or_below(graph):
    up = ["{} (layer {}) imports {} (layer {})".format(a, layer(a), b, layer(b))
          for a, targets in graph.items() for b in targets if layer(b) > layer(a)]
    assert up == []


def test_the_import_graph_has_no_circle(graph):
    done, path, circles = set(), [], []

    def visit(node):
        if node in path:
            circles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        path.append(node)
        for target in sorted(graph[node]):
            visit(target)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert circles == []


def test_the_graph_reader_sees_function_level_imports(graph):
    # runners/__init__.py imports its runners inside build_runner only.
    assert {"runners.lean", "runners.rnn", "runners.fairseq_runner"} <= graph["runners"]


@pytest.mark.parametrize("kind,model", [("fairseq", "transformer"), ("lean", "transformer"), ("rnn", "lstm")])
def test_every_runner_has_the_declared_interface(loaded, kind, model):
    from fairseq_stream.runners import build_runner
    from fairseq_stream.runners.base import RowGroup, Runner

    models, task = loaded(model)
    runner = build_runner(kind, models)
    assert isinstance(runner, Runner) and runner.name == kind
    sample = task.dataset("valid").collater([task.dataset("valid")[i] for i in range(2)])
    state = runner.start(sample["net_input"], 2)
    assert isinstance(state, RowGroup) and state.rows == 4


# The modules that drive a BeamDecoder through its stepping interface (schedule.pool.CohortDecoder).
DECODER_DRIVERS = ("engine.py", "schedule/pool.py", "schedule/stream.py", "schedule/wrapper.py", "api.py")


def decoder_attributes(path):
    """The attributes ``path`` reads of a decoder: ``decoder.X`` and ``self.decoder.X``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id == "decoder":
            names.add(node.attr)
        elif isinstance(owner, ast.Attribute) and owner.attr == "decoder" and isinstance(owner.value, ast.Name) \
                and owner.value.id == "self":
            names.add(node.attr)
    return names


def test_the_pool_and_schedulers_use_only_the_decoders_stepping_interface():
    from fairseq_stream.schedule.pool import CohortDecoder

    declared = set(CohortDecoder.__annotations__) | {n for n in vars(CohortDecoder) if not n.startswith("_")}
    used = {name: decoder_attributes(PACKAGE / name) for name in DECODER_DRIVERS}
    assert all(used.values()), "the reader found no decoder attribute: {}".format(used)
    assert {name: sorted(attrs - declared) for name, attrs in used.items()} == {name: [] for name in used}


def test_the_beam_decoder_has_the_declared_stepping_interface(loaded):
    from fairseq_stream.decoder import BeamDecoder
    from fairseq_stream.jacobi.decoder import JacobiDecoder
    from fairseq_stream.schedule.pool import CohortDecoder

    models, task = loaded("transformer")
    decoder = BeamDecoder(models, task.target_dictionary, beam_size=2)
    assert isinstance(decoder, CohortDecoder)
    sample = task.dataset("valid").collater([task.dataset("valid")[i] for i in range(3)])
    cohort = decoder.open(sample["net_input"])
    first, rest = decoder.split(cohort, 1)
    assert (first.size, rest.size) == (1, 2)
    assert decoder.join([first, rest]).ids.tolist() == [0, 1, 2]
    # Jacobi decodes whole batches: fairseq's generate only, no cohorts.
    greedy = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", keep_reference=False)
    assert not isinstance(JacobiDecoder(greedy), CohortDecoder)


def test_each_folder_sits_at_one_layer():
    # A dotted key would place one module of a folder apart from the rest: move the module instead.
    assert [name for name in LAYERS if "." in name] == []


# The modules that drive the greedy decoder through Jacobi's interface (jacobi.interface.GreedyDecoder).
JACOBI_DRIVERS = ("jacobi/decoder.py", "jacobi/calibration.py")


def greedy_attributes(path):
    """The attributes ``path`` reads of a greedy decoder: ``greedy.X``, ``probe.X`` (a copy at other lengths)
    and ``<anything>.greedy.X``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("greedy", "probe"):
            names.add(node.attr)
        elif isinstance(owner, ast.Attribute) and owner.attr == "greedy":
            names.add(node.attr)
    return names


def test_jacobi_uses_only_the_declared_greedy_interface(loaded):
    from fairseq_stream.decoder import BeamDecoder
    from fairseq_stream.jacobi.interface import GreedyDecoder

    declared = set(GreedyDecoder.__annotations__) | {n for n in vars(GreedyDecoder) if not n.startswith("_")}
    used = {name: greedy_attributes(PACKAGE / name) for name in JACOBI_DRIVERS}
    assert all(used.values()), "the reader found no greedy attribute: {}".format(used)
    assert {name: sorted(attrs - declared) for name, attrs in used.items()} == {name: [] for name in used}
    models, task = loaded("transformer")
    greedy = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", keep_reference=False)
    assert isinstance(greedy, GreedyDecoder) and isinstance(greedy.with_lengths(0, 5, 5), GreedyDecoder)


def test_the_pool_planner_holds_no_decoder(graph):
    """schedule/plan.py decides and returns plans; the pool's loop executes them (vLLM's ``schedule()`` /
    ``update_from_output``): the planner imports nothing that runs a model and names no decoder."""
    assert graph["schedule.plan"] <= {"cohort"}
    assert decoder_attributes(PACKAGE / "schedule" / "plan.py") == set()
