"""The package's shape, read from the source with ast (an import inside a function counts as much
as one at the top): the ground floors import nothing above them and stay free of torch and
Megatron, every package imports only what the map below allows, no two packages import each other,
no feature imports another's command line or a benchmark, and nothing inside the package goes
through ``megatron_dynapipe.megatron``, the face kept for Megatron-LM users; only the named
packages import megatron-core; and no module or function is longer than a reader holds at once."""

import ast
import pkgutil
import subprocess
import sys

import megatron_dynapipe.config as config
import megatron_dynapipe.planning as planning

from project import ROOT

PACKAGE = ROOT / "megatron_dynapipe"

#: what each unit (a sub-package or a top-level module) may import, the arrows of docs/architecture.md's map
ALLOWED = {
    "config": set(),
    "compat": set(),
    "files": set(),
    "progress": set(),
    "interrupts": set(),
    "local_ranks": set(),
    "chrome_trace": {"files"},
    "planning": {"config"},
    "viz": {"planning", "chrome_trace", "files"},
    "gpt": {"config", "compat"},
    "data": {"config", "planning", "hardware"},
    "runtime": {"config", "planning", "compat", "gpt", "data"},
    "profiling": {"config", "planning", "compat", "gpt", "runtime", "data", "files", "progress", "local_ranks",
                  "hardware"},
    "hardware": {"config", "planning", "files"},
    "tracer": {"config", "planning", "compat", "gpt", "files", "progress", "chrome_trace", "hardware", "interrupts",
               "runtime", "data"},
    "simulate": {"config", "planning", "tracer", "files", "progress", "chrome_trace", "local_ranks", "hardware",
                 "interrupts", "data", "profiling"},
    "megatron_lm": {"config", "planning", "compat", "gpt", "runtime", "data", "tracer", "files", "hardware"},
    "megatron": {"megatron_lm", "runtime"},
    "bench": {"chrome_trace", "config", "planning", "compat", "gpt", "runtime", "data", "profiling", "local_ranks", "files",
              "progress", "hardware"},
    "cli": {"config", "planning", "compat", "tracer", "profiling", "simulate", "megatron_lm", "bench", "files",
            "viz", "hardware", "interrupts", "progress"},
}


def _modules(package) -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."))


def test_the_ground_floors_import_neither_torch_nor_megatron():
    modules = _modules(planning) + _modules(config)
    assert "megatron_dynapipe.planning.planner" in modules and "megatron_dynapipe.config.accounting" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def _imports(path, module: str, is_package: bool, package: str = "megatron_dynapipe") -> set[str]:
    """Every ``package`` module ``module`` (the file at ``path``) names in an import."""
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
                found |= {f"{node.module}.{alias.name}" for alias in node.names}  # a module imported by name
    return {name for name in found if name.split(".")[0] == package}


def _unit(module: str) -> str:
    """A sub-package (planning, tracer, ...) or a top-level module (cli, viz, files)."""
    return module.split(".")[1] if module.count(".") else module


def module_imports(package: str = "megatron_dynapipe") -> dict[str, set[str]]:
    """module -> the modules of ``package`` (or names within them) it imports."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        if module != "megatron_dynapipe":  # the package's own lazy re-exports
            out[module] = _imports(path, module, is_package, package)
    return out


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in module_imports().items():
        source = _unit(module)
        for target in targets:
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
    assert {"planning", "tracer", "runtime", "megatron_lm", "compat", "config"} <= set(graph) | set(ALLOWED)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_every_package_imports_only_what_the_map_allows():
    graph = package_graph()
    assert set(graph) <= set(ALLOWED), f"units missing from ALLOWED: {sorted(set(graph) - set(ALLOWED))}"
    extra = {unit: sorted(targets - ALLOWED[unit]) for unit, targets in graph.items() if targets - ALLOWED[unit]}
    assert not extra, f"imports the map does not allow: {extra}"


def test_the_map_catches_a_forbidden_arrow():
    """The checks above can fail: a planning module that imported torch-side code would be refused."""
    assert "tracer" not in ALLOWED["planning"] and "cli" not in ALLOWED["tracer"]
    assert _unit("megatron_dynapipe.tracer.cli") == "tracer" and _unit("megatron_dynapipe.cli") == "cli"
    assert find_cycle({"tracer": {"simulate"}, "simulate": {"tracer"}}) == ["simulate", "tracer", "simulate"]


def test_no_feature_imports_another_features_command_line_or_a_benchmark():
    bad = []
    for module, targets in module_imports().items():
        for target in targets:
            other_package = _unit(target) != _unit(module)
            if other_package and target.endswith(".cli") and module != "megatron_dynapipe.cli":
                bad.append(f"{module} -> {target}")
            if _unit(target) == "bench" and _unit(module) not in ("bench", "cli"):
                bad.append(f"{module} -> {target}")
    assert not bad, f"command lines and benchmarks are imported only by the top-level command: {bad}"


def test_nothing_inside_the_package_goes_through_the_megatron_face():
    users = sorted(module for module, targets in module_imports().items()
                   if _unit(module) != "megatron" and any(_unit(t) == "megatron" for t in targets))
    assert users == [], f"import megatron_lm or runtime directly, not the megatron face: {users}"


#: the packages that import megatron-core (or Megatron-LM) themselves: what builds, runs, traces or
#: measures its models. The runtime is not among them: it calls megatron-core through compat/core.py.
MEGATRON_IMPORTERS = {"compat", "gpt", "data", "tracer", "profiling", "megatron_lm", "bench"}


def test_only_the_named_packages_import_megatron():
    users = {_unit(module) for module, targets in module_imports("megatron").items() if targets}
    assert users == MEGATRON_IMPORTERS, (f"import megatron-core in {sorted(MEGATRON_IMPORTERS)} alone (the runtime "
                                         f"through compat/core.py); found {sorted(users)}")


MODULE_LINES, FUNCTION_LINES = 600, 80  # what a reader holds at once


def test_no_module_is_longer_than_a_reader_holds():
    long = {str(path.relative_to(ROOT)): lines for path in sorted(PACKAGE.rglob("*.py"))
            if (lines := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"split these modules ({MODULE_LINES} lines at most): {long}"


def test_a_function_over_80_lines_says_why_it_must_be_one_piece():
    """Its docstring or a comment in it says what is done "on purpose" by keeping it whole."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.end_lineno - node.lineno >= FUNCTION_LINES and "on purpose" not in ast.get_source_segment(source, node):
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, f"split these functions, or say why each is one piece (\"on purpose\"): {long}"
