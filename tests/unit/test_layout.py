"""The shape of the code: no import cycles, and each package imports only what it may.

Every import statement counts -- module level, inside functions, under TYPE_CHECKING --
because a lazy or type-only back-reference is still a cycle in the design.
"""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("dlrt", "dlrt_bench", "dlrt_cluster", "autops", "infiniswap", "tiresias")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import statement in the file; module
    level is anywhere outside a function body (under ``if``, ``try`` or in a class too): what
    runs when the module is imported."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    in_functions = {id(inner) for node in ast.walk(tree)
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    for inner in ast.walk(node) if inner is not node}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        found += [(t, id(node) not in in_functions) for t in targets]
    return found


def _commands() -> set[str]:
    """The modules behind the console scripts (pyproject.toml's ``[project.scripts]``)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r'^\s*[\w-]+\s*=\s*"([\w.]+):', section, re.MULTILINE))


MODULES = _modules()
COMMANDS = _commands()
GRAPH = {m: {t for t, _ in _imports(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}


def _cycles() -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return cycles


def test_the_scan_sees_the_packages():
    assert {"dlrt.messages", "autops.master.pmaster", "infiniswap.daemon", "tiresias.driver"} <= set(MODULES)
    assert "autops.wire.protocol" in GRAPH["autops.master.pmaster"]
    assert COMMANDS == {"autops.cli", "tiresias.cli", "infiniswap.cli", "dlrt.main"}


def test_no_import_cycles():
    assert _cycles() == []


def _importers(prefix: str) -> dict[str, list[tuple[str, bool]]]:
    out: dict[str, list[tuple[str, bool]]] = {}
    for m, p in MODULES.items():
        hits = [(t, top) for t, top in _imports(m, p) if t == prefix or t.startswith(prefix + ".")]
        if hits:
            out[m] = hits
    return out


def test_shared_core_imports_none_of_the_systems():
    """... nor the benchmarks, but for its command's ``testbed`` (lazily: the tests below)."""
    for system in ("autops", "infiniswap", "tiresias"):
        assert [m for m in _importers(system) if m.startswith("dlrt.")] == []
    assert [m for m in _importers("dlrt_bench") if m.startswith("dlrt.") and m not in COMMANDS] == []


def test_tiresias_stands_alone_and_autops_simulation_reads_traces_as_data():
    for system in ("autops", "infiniswap"):
        assert [m for m in _importers(system) if m.startswith("tiresias")] == []
    assert [m for m in _importers("tiresias") if m.startswith("autops")] == []


def test_the_cluster_package_sits_above_the_systems():
    """``dlrt_cluster`` wires the three systems; none of them imports it, and the shared core
    only from its command, lazily (``dlrt cluster`` named on the command line)."""
    for module, hits in _importers("dlrt_cluster").items():
        if module.startswith("dlrt_cluster"):
            continue
        assert module in COMMANDS and module.startswith("dlrt."), f"{module} imports dlrt_cluster"
        assert not any(top for _, top in hits), f"{module} imports dlrt_cluster at module level"
    assert [m for m in _importers("dlrt_bench") if m.startswith("dlrt_cluster")] == []


def test_libraries_import_benchmarks_only_lazily_from_their_cli():
    for module, hits in _importers("dlrt_bench").items():
        if module.startswith("dlrt_bench"):
            continue
        assert module in COMMANDS, f"{module} imports the benchmark package"
        assert not any(top for _, top in hits), f"{module} imports the benchmark package at module level"


def test_no_library_module_imports_the_benchmarks_at_module_level():
    """Importing any module of dlrt, autops, infiniswap or tiresias loads nothing of dlrt_bench
    (the testbed included): an import inside a function, run only when a command asks for a
    benchmark or the testbed, is the one form allowed."""
    eager = [f"{module} <- {target}" for module, hits in _importers("dlrt_bench").items()
             if not module.startswith("dlrt_bench") for target, top in hits if top]
    assert eager == []


AUTOPS_PROCESSES = ("autops.worker", "autops.aggregator", "autops.master")
AUTOPS_SHARED = ("autops.wire", "autops.transport")
AUTOPS_LEAVES = ("autops.config", "autops.models")     # plain data any of them may read
AUTOPS_CONFIG = "autops.config"         # the settings: the one leaf the other leaves may read


def _within(module: str, packages) -> str | None:
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def test_the_autops_processes_import_only_the_shared_layers_below_them():
    """A worker, an aggregator and pMaster share ``wire`` and ``transport``, and nothing of
    each other; the shared layers import none of the processes nor what sits above them."""
    assert {"autops.worker.agent", "autops.aggregator.service", "autops.master.pmaster",
            "autops.wire.protocol"} <= set(MODULES)
    for module, deps in GRAPH.items():
        own = _within(module, AUTOPS_PROCESSES)
        shared = _within(module, AUTOPS_SHARED)
        for dep in deps:
            if not dep.startswith("autops.") or dep == module:
                continue
            if own is not None:
                assert _within(dep, AUTOPS_PROCESSES) in (None, own), f"{module} imports {dep}"
                assert _within(dep, AUTOPS_PROCESSES + AUTOPS_SHARED + AUTOPS_LEAVES), f"{module} imports {dep}"
            if shared is not None:
                assert _within(dep, AUTOPS_SHARED + AUTOPS_LEAVES), f"{module} (shared) imports {dep}"
            if module in AUTOPS_LEAVES and (module == AUTOPS_CONFIG or dep != AUTOPS_CONFIG):
                raise AssertionError(f"{module} is a leaf and imports {dep}")


def test_no_private_name_is_imported_across_packages():
    """``from pkg.mod import _name`` only within ``pkg``."""
    bad = []
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base not in MODULES:
                continue
            source = base if MODULES[base].name == "__init__.py" else base.rsplit(".", 1)[0]
            bad += [f"{module} <- {base}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__") and source != package
                    and f"{base}.{a.name}" not in MODULES]
    assert bad == []


ENV_PREFIX = "AUTOPS_"


def _environ_reads(source: str, label: str) -> list[str]:
    """Where ``source`` (module ``label``) reads an ``AUTOPS_*`` variable from the environment: ``X.get(NAME)``,
    ``X[NAME]`` (read), ``X.pop(NAME)`` or ``NAME in X`` with ``X`` an ``environ``
    (``os.environ``, an ``environ`` argument), or ``os.getenv(NAME)``; ``NAME`` a string
    literal or a name bound to one in this module (or imported under it from ``autops.config``)."""
    tree = ast.parse(source)
    names = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
             for t in n.targets if isinstance(t, ast.Name)}
    config = ast.parse((ROOT / "autops" / "config.py").read_text())
    exported = {t.id: n.value.value for n in config.body if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                for t in n.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update({a.asname or a.name: exported[a.name] for a in node.names if a.name in exported})

    def variable(node: ast.AST) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else names.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith(ENV_PREFIX) else None

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "environ") or \
            (isinstance(node, ast.Attribute) and node.attr == "environ")

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr in ("get", "pop") and is_environ(node.func.value)) or \
                    (node.func.attr == "getenv" and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(is_environ(c) for c in node.comparators):
            key = node.left
        name = variable(key) if key is not None else None
        if name:
            found.append(f"{label}:{node.lineno} reads ${name}")
    return found


def test_only_autops_config_reads_autops_variables():
    """AutoPS's settings come from one place: no module of ``autops/`` but ``autops/config.py``
    reads an ``AUTOPS_*`` variable (writing one into a child's environment is fine)."""
    reads = [hit for module, path in MODULES.items() if module.startswith("autops.") and module != AUTOPS_CONFIG
             for hit in _environ_reads(path.read_text(), module)]
    assert reads == []
    assert _environ_reads((ROOT / "autops" / "config.py").read_text(), AUTOPS_CONFIG)   # it sees the reads there
    probe = ("import os\nfrom autops.config import WARM_ENV as W\nNAME = 'AUTOPS_X'\n"       # and these
             "a = os.environ.get('AUTOPS_A')\nb = os.getenv(NAME)\nc = os.environ[W]\n"
             "d = 'AUTOPS_D' in os.environ\ndef f(environ):\n    return environ.get(NAME, '')\n"
             "os.environ['AUTOPS_E'] = '1'\nenv = dict(os.environ, AUTOPS_F='1')\nprint('AUTOPS_G')\n")
    assert sorted(_environ_reads(probe, "probe")) == [
        "probe:4 reads $AUTOPS_A", "probe:5 reads $AUTOPS_X", "probe:6 reads $AUTOPS_WARM_BYTES",
        "probe:7 reads $AUTOPS_D", "probe:9 reads $AUTOPS_X"]

