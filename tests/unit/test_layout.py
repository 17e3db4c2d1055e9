"""The tree's structure holds: no import circles (lazy imports included), imports only go down the floors
(server -> jinfer -> pallas_kernels), and no production file grows past the size we can still read."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "jinfer", "pallas_kernels")  # top floor first
MAX_LINES = 500
MAX_CORE_LINES = 350  # engine/core.py: schedule -> execute -> update -> emit, nothing else


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def _cycles(graph: dict[str, set[str]], nodes) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles():
    mods = _modules()
    assert _cycles(_import_graph(mods), sorted(mods)) == []


def test_cycle_finder_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, "abcd") == [["a", "b", "c"]]


def test_imports_go_down_the_floors():
    floor = {p: i for i, p in enumerate(PACKAGES)}
    graph = _import_graph(_modules())
    upward = sorted((m, t) for m, targets in graph.items() for t in targets
                    if floor[t.split(".")[0]] < floor[m.split(".")[0]])
    assert upward == []


def test_production_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}
    assert sizes["jinfer/engine/core.py"] <= MAX_CORE_LINES
