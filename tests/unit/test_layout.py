"""The package's layout: no import cycles (static, every import counted), no two modules with the same
file name, and documentation that refers only to files in the repository."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megathunder"


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``__init__`` is its package)."""
    out = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports: top level, inside functions and under
    ``TYPE_CHECKING`` alike (a hidden import is still an edge). ``from pkg import name`` counts as
    an edge to ``pkg.name`` when that is a module, else to ``pkg``."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t) if t.split(".")[0] == PACKAGE.name else None
                if r is not None and r != m:
                    edges[m].add(r)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_inside_the_package():
    assert cycles(import_graph(module_names())) == []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "megathunder"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from megathunder.a import y\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from megathunder.a.x import thing\n")
    (pkg / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megathunder.a.x\n")
    assert cycles(import_graph(module_names(pkg))) == [["megathunder.a.x", "megathunder.a.y"]]


def test_no_two_modules_share_a_file_name():
    names = Counter(f.name for f in PACKAGE.rglob("*.py") if f.name != "__init__.py")
    assert sorted(n for n, c in names.items() if c > 1) == []


DOCS = ["README.md", "BENCHMARKS.md", "RELIABILITY.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def test_docs_and_code_refer_only_to_the_repository():
    """No pointer to design notes outside the repository, and no issue numbers."""
    texts = {d: (REPO / d).read_text() for d in DOCS}
    texts.update({str(f.relative_to(REPO)): f.read_text() for f in PACKAGE.rglob("*.py")})
    outside = re.compile(r"\.\./shared|\bDESIGN\.md|\bFEASIBILITY\.md|\b[Ii]ssues? \d+|\(issue\b")
    bad = [f"{name}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
           for name, text in texts.items() for m in outside.finditer(text)]
    assert bad == []


def test_repository_paths_named_in_the_docs_exist():
    """Every `path/like/this.py` (or a folder) the docs name in backticks is in the repository."""
    path = re.compile(r"`((?:megathunder|tests|tools|launch|configs|docs)/[\w./-]*)`")
    missing = sorted({f"{d}: {m}" for d in DOCS for m in path.findall((REPO / d).read_text())
                      if not (REPO / m.split(":")[0].rstrip(".")).exists()})
    assert missing == []
