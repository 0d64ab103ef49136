"""The package boundaries of the architecture, checked on the imports themselves (every module, parsed).

* ``cost_model/`` predicts with numpy alone: it imports no torch, no simulator, no compiler.
* The simulator (``autofuse/npu``) counts and never calls a cost formula: from ``cost_model`` it reads only
  data shared by both sides (device and link profiles, the Vector program IR and its tile schedule, the
  kernels' tile geometry and dtype rules), and those modules import no formula module in turn.
* ``patterns/`` uses torch, networkx and the compiler's graph and match types, never the simulator.
* ``examples/`` use the public API.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# cost_model modules that hold data, the program IR or kernel geometry, no cost formula
SHARED_DATA = {"cost_model.devices", "cost_model.links", "cost_model.program", "cost_model.lowering",
               "cost_model.conv_geometry", "cost_model.vecutil", "cost_model.grouped_matmul_tiling",
               "cost_model.attention_tiling"}
PATTERN_HELPERS = {"autofuse.graph", "autofuse.match", "autofuse.canonicalize", "autofuse.vector_program",
                   "autofuse.groups"}
PUBLIC = {"autofuse", "autofuse.distributed", "autofuse.tp_models"}


def _imports(path: pathlib.Path) -> set:
    """Absolute module names imported anywhere in ``path`` (function-level imports included)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
    return out


def _modules(pkg: str):
    files = sorted((ROOT / pkg).rglob("*.py"))
    assert files, pkg
    return [(f.relative_to(ROOT).as_posix(), _imports(f)) for f in files]


def _ours(names, *tops):
    return {m for m in names if m.split(".")[0] in tops}


def test_the_cost_model_needs_numpy_alone():
    for path, names in _modules("cost_model"):
        assert not _ours(names, "torch", "autofuse", "patterns", "networkx"), (path, names)


def test_the_simulator_reads_no_cost_formula():
    for path, names in _modules("autofuse/npu"):
        used = _ours(names, "cost_model")
        assert used <= SHARED_DATA, (path, used - SHARED_DATA)
    for mod in SHARED_DATA:
        path = ROOT / (mod.replace(".", "/") + ".py")
        used = _ours(_imports(path), "cost_model")
        assert used <= SHARED_DATA | {"cost_model.common"}, (mod, used)


def test_patterns_do_not_reach_into_the_simulator_or_the_planner():
    for path, names in _modules("patterns"):
        used = _ours(names, "autofuse")
        assert used <= PATTERN_HELPERS, (path, used - PATTERN_HELPERS)
        assert not _ours(names, "cost_model"), path


@pytest.mark.parametrize("path,names", _modules("examples"), ids=lambda x: x if isinstance(x, str) else "")
def test_examples_use_the_public_api(path, names):
    used = _ours(names, "autofuse", "cost_model", "patterns")
    assert used <= PUBLIC, (path, used - PUBLIC)
