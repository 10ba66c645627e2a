"""The package's shape: the planning core stays free of torch and Megatron, and no two packages
import each other (directly or round a longer loop). Read from the source with ast, so that an
import inside a function counts as much as one at the top."""

import ast
import pkgutil
import subprocess
import sys

import megatron_dynapipe.planning as planning
from conftest import ROOT

PACKAGE = ROOT / "megatron_dynapipe"


def test_no_planning_module_imports_torch_or_megatron():
    modules = sorted(f"megatron_dynapipe.planning.{m.name}" for m in pkgutil.iter_modules(planning.__path__))
    assert "megatron_dynapipe.planning.planner" in modules and len(modules) >= 10
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def _imports(path, module: str, is_package: bool) -> set[str]:
    """Every megatron_dynapipe module ``module`` (the file at ``path``) names in an import."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if is_package else -1]
                base = base[: len(base) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return {name for name in found if name.split(".")[0] == "megatron_dynapipe"}


def _unit(module: str) -> str:
    """A sub-package (planning, tracer, ...) or a top-level module (cli, viz, files)."""
    return module.split(".")[1] if module.count(".") else module


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        if module == "megatron_dynapipe":
            continue  # the package's own lazy re-exports
        source = _unit(module)
        for target in _imports(path, module, is_package):
            if target != "megatron_dynapipe" and _unit(target) != source:
                graph.setdefault(source, set()).add(_unit(target))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of arrows in ``graph`` (as the list of its nodes, first repeated last), or None."""
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None


def test_no_two_packages_import_each_other():
    graph = package_graph()
    assert {"planning", "tracer", "megatron", "compat"} <= set(graph) | {t for ts in graph.values() for t in ts}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_the_ground_floors_import_nothing_above_them():
    graph = package_graph()
    assert graph.get("config", set()) == set()
    assert graph.get("planning", set()) <= {"config"}
    assert graph.get("compat", set()) == set()
