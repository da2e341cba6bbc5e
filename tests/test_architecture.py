"""The tree shows the design (docs/ARCHITECTURE.md): no import circles in replay_lib, replay_tui or capture, and
no lower room of replay_lib imports a higher one.

Imports are read with ``ast`` from the source (nothing is imported), at module level and inside functions alike;
imports under ``if TYPE_CHECKING:`` are left out (they never run), and a package importing its own submodules
is not a circle (``from . import x`` in ``pkg/__init__.py``), nor is a submodule importing its package's
``__init__`` for a name the package re-exports from another module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("replay_lib", "replay_tui", "capture")

# replay_lib's rooms, bottom to top (docs/ARCHITECTURE.md): a module may import its own room, a lower one, and
# the leaves (errors, safe_text) — never a higher room. Rooms of one rank do not import each other.
ROOM_RANK = {
    "errors": 0, "safe_text": 0,
    "bundle": 1,
    "kernels": 2, "frameworks": 2,
    "judge": 3,
    "stages": 4,
    "explain": 5,
    "run": 6,
    "importers": 7, "demo": 7,
    "cli": 8, "__main__": 9,
}
# Deprecated re-exports of old module paths (README, "Deprecated import paths"): nothing inside imports them.
SHIMS = {"replay_lib.schema": "replay_lib.bundle.schema", "replay_lib.runner": "replay_lib.run.runner",
         "replay_lib.report": "replay_lib.judge.report"}


def _module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _known(name: str) -> str | None:
    """The module of ours that ``name`` (a module or a module.attribute) lands in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The modules of ours that ``module`` imports (what ``import x.y`` and ``from x import y`` load)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            hit = _known(target)
            # a package importing its own submodules, or a submodule its own package: not an edge
            if hit is None or hit == module or hit.startswith(module + ".") or module.startswith(hit + "."):
                continue
            out.add(hit)
    return out


def import_graph() -> dict[str, set[str]]:
    return {m: imports_of(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each in a readable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One circle through the component, as a → b → … → a."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in members)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return " → ".join(path + [start])
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            return " → ".join(path + [nxt[0]]) if nxt else " ↔ ".join(component)
        path.append(fresh[0])
        seen.add(fresh[0])


def test_the_walker_sees_a_circle(tmp_path):
    """The check can fail: a circle of two modules is found and named, and TYPE_CHECKING imports are not one."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b"]]
    assert _cycle_path(graph, ["a", "b"]) == "a → b → a"
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import Y\nimport os\n")
    skipped = _type_checking_nodes(tree)
    assert [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skipped] == ["typing"]


def test_no_import_circles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(_cycle_path(graph, c) for c in found)


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "replay_lib" or len(parts) == 1:
        return None
    return parts[1]


def test_rooms_import_only_downward():
    """Every replay_lib module sits in a room of ROOM_RANK, and imports only its own room, lower ones and the
    leaves; the deprecated re-exports are imported by nothing of ours."""
    graph = import_graph()
    unplaced = sorted({_room(m) for m in graph if _room(m) and _room(m) not in ROOM_RANK and m not in SHIMS})
    assert not unplaced, f"modules outside every room: {unplaced} (add them to a room, docs/ARCHITECTURE.md)"
    upward = []
    for module, deps in sorted(graph.items()):
        room = _room(module)
        if room is None or module in SHIMS:
            continue
        for dep in sorted(deps):
            if dep in SHIMS:
                upward.append(f"{module} imports the deprecated {dep} (use {SHIMS[dep]})")
                continue
            other = _room(dep)
            if other is None or other == room:
                continue
            if ROOM_RANK[other] >= ROOM_RANK[room]:
                upward.append(f"{module} ({room}, rank {ROOM_RANK[room]}) imports {dep} ({other}, rank "
                              f"{ROOM_RANK[other]})")
    for module, deps in sorted(graph.items()):  # the TUI and capture never import the old paths either
        if not module.startswith("replay_lib"):
            upward.extend(f"{module} imports the deprecated {d}" for d in sorted(deps) if d in SHIMS)
    assert not upward, "\n".join(upward)


def test_replay_lib_top_level_is_rooms_and_leaves():
    """The top level holds the rooms, the two leaves, the entry points and the deprecated re-exports — nothing
    else (a new module goes into a room)."""
    top = sorted(p.stem if p.is_file() else p.name for p in (ROOT / "replay_lib").iterdir()
                 if (p.is_file() and p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists()))
    expected = sorted({*ROOM_RANK, "__init__", *(s.rpartition(".")[2] for s in SHIMS)})
    assert top == expected


@pytest.mark.parametrize("old,new", sorted(SHIMS.items()))
def test_deprecated_paths_still_import(old, new):
    """replay_lib.schema / runner / report keep working as re-exports (one minor version), with a warning."""
    code = (f"import warnings, sys\nwarnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as w:\n    import {old} as old\n"
            f"import {new} as new\n"
            f"names = [n for n in dir(new) if not n.startswith('__')]\n"
            f"assert all(getattr(old, n) is getattr(new, n) for n in names), 'a name differs'\n"
            f"print(len(names), [str(x.message) for x in w if x.category is DeprecationWarning])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, _, message = out.stdout.partition(" ")
    assert int(count) > 5
    assert f"{old} is deprecated: import {new} (removed in 0.2.0)" in message


def test_public_surface():
    """What users wrote keeps working: replay_lib.replay, BundleWriter/BundleReader from replay_lib.bundle, the
    CLI entry point, capture's names."""
    import replay_lib
    from replay_lib.bundle import BundleReader, BundleWriter
    from replay_lib.cli import main
    from replay_lib.run.runner import replay

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replay_lib.replay is replay
    assert BundleReader.__module__ == "replay_lib.bundle.reader"
    assert BundleWriter.__module__ == "replay_lib.bundle.writer"
    assert main.__module__ == "replay_lib.cli.entry"
