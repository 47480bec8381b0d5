"""The package's layers: no import cycle (lazy imports and imports for type checking included),
the config schema depends on nothing of ours, and every module imports on its own."""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pipelinerl_fsdp"


def module_name(path: Path, pkg: Path = PKG) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(module: str, is_package: bool, tree: ast.AST, mods: set[str]) -> set[str]:
    """The package's modules that `module` (its syntax tree) imports, at the top, inside functions or for type
    checking: absolute imports; relative ones, resolved against the module's package (`from ..x import y` in
    `p.a.b` -> `p.x` and `p.x.y`); `importlib.import_module` of a literal name. Not the registries' loops
    (`import_module(f"{__name__}.{name}")` at the end of `tasks/` and `rl/objectives/`): a package loading its own
    plugins once all they import from it is defined, a cycle by design within one unit."""
    package = module if is_package else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                head = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{head}.{base}" if base else head
            targets.update([base, *(f"{base}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                targets.add(arg.value)
    return {t for t in targets if t in mods and t != module}


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the package's modules it imports (`imported_names`)."""
    paths = {module_name(p, pkg): p for p in pkg.rglob("*.py")}
    mods = set(paths)
    return {
        m: imported_names(m, path.name == "__init__.py", ast.parse(path.read_text()), mods) for m, path in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_resolves_relative_and_importlib_imports(tmp_path):
    """An upward or cyclic import written relatively, or through importlib, is an edge like any other."""
    files = {
        "p/__init__.py": "",
        "p/low/__init__.py": "",
        "p/low/a.py": "def f():\n    from ..high import b\n",
        "p/low/c.py": "from . import a\n",
        "p/high/__init__.py": "",
        "p/high/b.py": "import importlib\nimportlib.import_module('p.low.c')\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path / "p")
    assert graph["p.low.a"] == {"p.high", "p.high.b"} and graph["p.low.c"] == {"p.low", "p.low.a"}
    assert graph["p.high.b"] == {"p.low.c"}
    assert cycles(graph) == [["p.high.b", "p.low.a", "p.low.c"]]
    assert "p.low.a -> p.high.b (floor 0 -> 1)" in upward_imports(graph, {"low": 0, "high": 1})


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_config_schema_imports_nothing_but_itself():
    graph = import_graph()
    config = {m for m in graph if unit(m) == "config"}
    assert config and all(graph[m] <= config for m in config), {m: graph[m] - config for m in config}


def test_each_module_imports_on_its_own():
    """Each module imported with none of ours loaded before it (third-party packages stay loaded: fast), in a
    forked child so that this process's modules are untouched."""
    names = sorted(module_name(p) for p in PKG.rglob("*.py"))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        failures = []
        for name in names:
            for m in [m for m in sys.modules if m == "pipelinerl_fsdp" or m.startswith("pipelinerl_fsdp.")]:
                del sys.modules[m]
            try:
                importlib.import_module(name)
            except BaseException as e:  # noqa: BLE001  (reported to the parent)
                failures.append(f"import {name}: {type(e).__name__}: {e}")
        os.write(write, "\n".join(failures).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        failures = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and not failures, failures


def test_the_layout_table_names_every_module():
    """The one layout table, in docs/architecture.md (the README points to it)."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        folder = path.parent.relative_to(PKG).as_posix() + "/"
        named = any(f"`{rel}`" in r for r in rows) or any(
            f"`{folder}`" in r and (path.name == "__init__.py" or f"`{path.name}`" in r) for r in rows
        )
        if not named:
            missing.append(rel)
    assert not missing, f"docs/architecture.md's layout table does not name {missing}"


# The package's floors, bottom first: a module imports only from floors below its own (never from its own floor's
# other units, never from above). A unit is a subpackage or a top-level module; a new one must be given a floor.
LAYERS: list[list[str]] = [
    ["config"],  # the schema: depends on nothing of ours
    ["runtime", "records"],  # stopping, faults, processes, host memory, GPU counts, CPU binding; records' reductions
    ["tokenizer", "samples", "models", "tools", "rewards", "engine_kinds", "checkpoint_layout"],
    ["data", "episodes", "perf"],  # perf: the performance model, needs only the models' shapes
    ["rl", "tasks"],  # pure math of training; tasks and environments
    ["transport", "preflight"],
    ["job"],  # the world, its process groups, the weight sync's layout
    ["job_inputs"],
    ["inference"],
    ["training", "plan_sizes"],  # the trainer; the sizes the plan counts from
    ["plan", "plan_performance", "configure"],
    ["train", "launch"],  # entry points
]


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_of() -> dict[str, int]:
    return {u: i for i, units in enumerate(LAYERS) for u in units}


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """Imports from a unit to one on its own floor or above (`a -> b` with the module names)."""
    out = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            ua, ub = unit(a), unit(b)
            if "__init__" in (ua, ub) or ua == ub:
                continue
            if floors[ub] >= floors[ua]:
                out.append(f"{a} -> {b} (floor {floors[ua]} -> {floors[ub]})")
    return out


def test_the_floor_checker_finds_an_upward_import():
    floors = {"low": 0, "high": 1}
    graph = {"p.low.a": {"p.high.b"}, "p.high.b": {"p.low.a"}}
    assert upward_imports(graph, floors) == ["p.low.a -> p.high.b (floor 0 -> 1)"]


def test_every_unit_has_a_floor():
    units = {unit(m) for m in import_graph()} - {"__init__"}
    assert units <= set(floor_of()), f"give these a floor in LAYERS: {sorted(units - set(floor_of()))}"


def test_imports_only_point_down():
    assert upward_imports(import_graph(), floor_of()) == []


def test_no_two_units_import_each_other():
    edges = {(unit(a), unit(b)) for a, bs in import_graph().items() for b in bs if unit(a) != unit(b)}
    mutual = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert mutual == [], f"units that import each other: {mutual}"


def test_the_unit_tests_mirror_the_package():
    """A unit test lives in the folder of the package it tests (tests/unit/rl/ for pipelinerl_fsdp/rl/, ...); the
    top level holds tests of top-level modules and of the repository (layers, launchers, benchmarks)."""
    tests = Path(__file__).resolve().parent
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= packages, f"test folders without a package: {sorted(folders - packages)}"
    assert all(list(tests.glob(f"{f}/test_*.py")) for f in folders), "an empty test folder"


def test_every_module_is_under_450_lines():
    """A module past 450 lines holds more than one concern: split it (the largest today is about 445)."""
    long = {
        p.relative_to(PKG).as_posix(): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) >= 450
    }
    assert long == {}, long


# The functions that may take the whole `Config`: the entry points, the job's world and inputs, the plan, the
# world-size rules and the config package's own parser, rules and writer. Everything else takes the sections it
# reads.
WHOLE_CONFIG = {
    "config/parse.py": {"_apply", "check_sections", "to_toml", "save_resolved"},
    "config/rules.py": {"check_rules"},
    "configure.py": {"validate_world"},
    "train.py": {"run", "run_rl"},
    "job/world.py": {"init_world"},
    "job_inputs.py": {"build_job_inputs"},
    "plan.py": {"make_plan"},
    "inference/worker.py": {"run_inference"},
    "training/rl_trainer.py": {"run_trainer"},
    "training/warmstart.py": {"run_warmstart"},
    "training/colocated.py": {"run_colocated"},
}


def test_only_the_entry_points_take_the_whole_config():
    taking: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.annotation is not None and ast.unparse(a.annotation).strip("'\"") == "Config" for a in params):
                    taking.setdefault(path.relative_to(PKG).as_posix(), set()).add(node.name)
    assert taking == WHOLE_CONFIG and sum(map(len, taking.values())) <= 15, taking
