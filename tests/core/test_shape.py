"""The tree's shape, held: no module over 800 lines, no import circle, no upward import in core.

Core's folders and top-level modules stand on declared layers (:data:`LAYERS`, ground floor
first); a unit may import its own layer or the ones below it, never one above. The walk reads
every ``import`` in the source (function-level and ``TYPE_CHECKING`` ones too: a deferred
import still ties two modules together), so the next feature cannot drift the shape silently.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "src"
PACKAGE = "lmcache_platform"
MAX_LINES = 800

#: Core's units (a subpackage or a top-level module; ``__init__`` is the curated root),
#: ground floor first. Add a new unit to the lowest layer its imports allow.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        "_errors _version _units _lazy _env _events _checks _codec _tinymodel _libc _headroom",
        "_types _ipc_wrapper",
        "_kv",
        "hostmem hookspecs",
        "_plugins",
        "_facade wire remote",
        "protocol",
        "client",
        "server __init__",
        "vllm conformance testing _bench",
        "_cli __main__",
    )
)


def _sources() -> Iterator[Path]:
    for top in ("core/src", "plugins-cpu/src", "plugins-cuda/src", "backends"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "build" not in path.relative_to(ROOT).parts:
                yield path


def _module(path: Path) -> tuple[str, bool]:
    """The dotted name of a core source file, and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _modules() -> dict[str, Path]:
    return {_module(p)[0]: p for p in sorted((CORE / PACKAGE).rglob("*.py"))}


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Core modules ``path`` imports, resolved to the module files that exist."""
    name, is_package = _module(path)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            target = ".".join(x for x in (base, node.module or "") if x)
            for alias in node.names:  # a submodule by name, or a name from the module itself
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return {m for m in found if m in known and m != name}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(p, known) for m, p in known.items()}


def test_no_source_module_is_over_800_lines() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _sources()}
    over = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert over == {}, f"split these modules (at most {MAX_LINES} lines each): {over}"


def test_every_unit_of_core_has_a_layer() -> None:
    units = {_unit(m) for m in _modules()}
    declared = set().union(*LAYERS)
    assert units - declared == set(), f"give these units a layer in LAYERS: {sorted(units - declared)}"
    assert declared - units == set(), f"LAYERS names units that do not exist: {sorted(declared - units)}"


def test_no_upward_import_between_layers() -> None:
    floor = {unit: i for i, names in enumerate(LAYERS) for unit in names}
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in _graph().items()
        for t in targets
        if floor.get(_unit(t), -1) > floor.get(_unit(m), len(LAYERS))
    )
    assert upward == [], f"imports from a lower layer up to a higher one: {upward}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_circle_between_core_packages() -> None:
    units: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        units.setdefault(_unit(m), set()).update(_unit(t) for t in targets if _unit(t) != _unit(m))
    circles = _cycles(units)
    assert circles == [], f"core's packages import each other in a circle: {circles}"


def test_no_import_circle_between_core_modules() -> None:
    circles = _cycles(_graph())
    assert circles == [], f"core's modules import each other in a circle: {circles}"


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
