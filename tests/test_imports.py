"""The house's rules that import-linter's contracts do not state: no module of rove is
over 600 lines, and no two import each other, directly or through others (imports
under `TYPE_CHECKING` aside; imports inside functions count, as they run too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

#: Lists every cycle of rove's import graph (grimp, import-linter's own graph builder),
#: run where `rove` is the source tree (the typecheck view `make lint` builds).
CYCLES = """
import sys
import grimp

graph = grimp.build_graph("rove", exclude_type_checking_imports=True)
index, low, stack, on, found = {}, {}, [], set(), []
sys.setrecursionlimit(10_000)

def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        cycle = []
        while not cycle or cycle[-1] != v:
            cycle.append(stack.pop())
            on.discard(cycle[-1])
        if len(cycle) > 1:
            found.append(sorted(cycle))

for module in sorted(graph.modules):
    if module not in index:
        visit(module)
print(len(graph.modules))
for cycle in found:
    print(" <-> ".join(cycle))
"""


def _view() -> Path:
    """A folder where `rove` is the source tree (as `make typecheck-view` makes it)."""
    view = ROOT / ".typecheck"
    (view / "rove").mkdir(parents=True, exist_ok=True)
    for part in ("control", "agent", "shard_service", "checkpoint"):
        link = view / "rove" / part
        if not link.exists():
            link.symlink_to(Path("..", "..", part))
    return view


def test_no_module_of_rove_imports_itself_through_others() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CYCLES],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(_view())},
        check=True,
    )
    count, *cycles = out.stdout.splitlines()
    assert int(count) > 100, "the graph holds rove's modules"
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


#: The most lines one module of rove may have (one concept per module).
MAX_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for part in ("control", "agent", "shard_service", "checkpoint")
        for path in (ROOT / part).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"over {MAX_LINES} lines: split by concept"
