"""The shape of the code and its documentation: no module imports a higher layer and no two modules know each
other (directly or around a circle; type-only and function-level imports included), nothing below the stages
takes a run's whole settings, no module grows past what a reader takes in, and every relative link in the
README and docs/ leads somewhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "accudiff"
MAX_MODULE_LINES = 450
# The layers, lowest first (docs/architecture.md draws them): a module may import its own layer and those below.
LAYERS = [
    ["accudiff.errors", "accudiff.text", "accudiff.version", "accudiff.memory", "accudiff.atomic", "accudiff.leftovers", "accudiff.deferred"],
    ["accudiff.model"],
    ["accudiff.runners"],
    ["accudiff.transforms"],
    ["accudiff.judging"],  # the vocabulary of judging: tolerances, statistics, decisions, the table
    ["accudiff.findings"],  # what a diagnosis says (the result types)
    ["accudiff.execution"],  # the process boundary: workers, what crosses it, the engine they run
    ["accudiff.diagnosis"],  # the rules: findings, suspects and causes from a table
    ["accudiff.report"],
    ["accudiff.settings", "accudiff.result", "accudiff.run_options"],
    ["accudiff.stages", "accudiff.verification", "accudiff.workspace", "accudiff.options", "accudiff.api", "accudiff.bisect", "accudiff.doctor"],
    ["accudiff", "accudiff.cli", "accudiff.pytest_plugin", "accudiff.checks"],
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every accudiff module `module` imports anywhere in its text (under TYPE_CHECKING, inside functions)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            named |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    deps = set()
    for name in named:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            deps.add(name)
    return deps


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_package():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def _layer(module: str) -> int:
    """The layer of the longest prefix that names `module`'s package or the module itself."""
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return max(matches)[1]


def test_no_module_imports_a_higher_layer():
    modules = _modules()
    upward = sorted((name, dep) for name, path in modules.items() for dep in _imports(name, path, modules) if _layer(dep) > _layer(name))
    assert upward == []


def test_nothing_below_the_stages_takes_a_runs_whole_settings():
    """Stages hand each function below them the values it reads, never the RunSettings object."""
    below = _layer("accudiff.settings")
    holders = sorted(name for name, path in _modules().items() if _layer(name) < below and "RunSettings" in path.read_text())
    assert holders == []


def test_the_stages_are_handed_small_values_not_a_runs_whole_settings():
    """api.py (and the bisectors' session) split a run's RunSettings into small values (what is compared, how
    it is judged, how causes are sought, how the runs spread, what was captured); the stages of stages/ and
    verification/ are handed only those they read."""
    holders = sorted(name for name, path in _modules().items()
                     if name.startswith(("accudiff.stages", "accudiff.verification")) and "RunSettings" in path.read_text())
    assert holders == []


def test_the_circle_finder_finds_a_type_only_circle():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_module_is_longer_than_a_reader_takes_in():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in _modules().values()}
    assert {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 5
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


if __name__ == "__main__":  # `python tests/test_architecture.py`: the layers as the imports draw them
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    for index in reversed(range(len(LAYERS))):
        members = sorted(name for name in modules if _layer(name) == index)
        reaches = sorted({_layer(dep) for name in members for dep in graph[name]} - {index})
        print(f"{index}: {', '.join(LAYERS[index])}  ({len(members)} modules; imports layers {reaches or 'none'})")
    upward = [(name, dep) for name, deps in graph.items() for dep in deps if _layer(dep) > _layer(name)]
    print(f"imports into a higher layer: {len(upward)}; import circles: {len(_cycles(graph))}")


def test_the_command_line_starts_without_pandas_or_onnx_runtime():
    # pandas (0.2 s, 40 MB) is imported on a thread while the comparison worker runs, and ONNX Runtime only in
    # the workers: an import at a module's top that pulls either into the command line's own start costs every
    # run that time before its first stage (judging/intervals.py once did, for a type hint).
    import subprocess
    import sys

    found = subprocess.run([sys.executable, "-c", "import sys, accudiff.cli; print(sorted({'pandas', 'onnxruntime'} & set(sys.modules)))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found == "[]"
