"""The layout stays as README's "Layout" section says: no import cycle in webapp/ or bench/ (imports
inside functions count too), files short enough to read top to bottom, one home for shared helpers."""

import ast
import re
from pathlib import Path

import pytest

from conftest import ROOT

# Pure data tables may be longer: (none in webapp/ today is over the limit).
LIMITS = {"webapp": 400, "bench": 600}


def modules(package: str) -> dict[str, Path]:
    """``{"webapp.cli.serve": path, ...}`` for every .py file under ``package``."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` (at ``path``) imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("package", ["webapp", "bench"])
def test_no_import_cycle(package):
    known = modules(package)
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    # A package's __init__ re-exporting its submodules is not a cycle unless a submodule imports it back.
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("package", ["webapp", "bench"])
def test_files_read_top_to_bottom(package):
    too_long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
                if (n := len(p.read_text(encoding="utf-8").splitlines())) > LIMITS[package]}
    assert not too_long, f"over {LIMITS[package]} lines: {too_long}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_readme_layout_names_every_module():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(webapp/[\w/]+(?:\.py|/))`", layout))
    modules = {f"webapp/{p.name}" for p in (ROOT / "webapp").glob("*.py")}
    packages = {f"webapp/{p.name}/" for p in (ROOT / "webapp").iterdir() if (p / "__init__.py").is_file()}
    assert modules | packages <= named, sorted((modules | packages) - named)
