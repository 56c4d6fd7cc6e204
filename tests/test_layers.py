"""The import layers of docs/design.md, as import-linter contracts in pyproject.toml: a new cycle between layers, the
trainer reaching above the rule book and the checkpoint format, or typer/rich outside the CLI fails the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is missing: pip install -e '.[test]'"
    done = subprocess.run([lint], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    assert "Contracts: 4 kept, 0 broken." in done.stdout, done.stdout[-2000:]


def test_no_import_cycle_between_modules_not_even_type_only():
    """No two modules of opskit import each other, directly or around a loop, counting every import statement
    (inside functions and under ``TYPE_CHECKING`` too): each module has a place below the ones that use it."""
    import grimp

    graph = grimp.build_graph("opskit", exclude_type_checking_imports=False)
    imports = {m: graph.find_modules_directly_imported_by(m) & graph.modules for m in graph.modules}
    cycles = [loop for loop in _strongly_connected(imports) if len(loop) > 1]
    assert cycles == [], cycles


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of a directed graph (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            child = next((c for c in successors if c not in index or c in on_stack), None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
            elif child in index:
                low[node] = min(low[node], index[child])
            else:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
    return found
