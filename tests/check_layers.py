"""The layer rule of DESIGN section 2, checked over the package's source.

Every module of ``sessionactors`` belongs to one layer. A core module imports
only from its own layer or the ones below it, never a plug-in; plug-ins import
the core and each other; nothing imports in a circle. Every import counts:
module level, function-local and under ``TYPE_CHECKING`` alike.

Run as a script (``make lint``) it prints each breach and exits 1; the tests
call :func:`breaches` on the real tree and on a deliberately broken copy.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Container, Iterator
from pathlib import Path

PACKAGE = "sessionactors"

#: Core layers, lowest first. A module not named here is a plug-in if it lives
#: under one of PLUGINS, and an error otherwise (a new module must pick a layer).
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("values", frozenset({"_records", "_events", "_errors", "_requests", "_model", "_final"})),
    (
        "pure logic",
        frozenset(
            {
                "_names",
                "_history",
                "_history_input",
                "_codec_format",
                "_codec_convert",
                "_codec_checks",
                "_codec_fast",
                "_codec_compact",
                "_codec",
                "_session",
                "_config",
                "_turns",
                "_json",
                "_export",
                "_listing",
                "_metadata",
            }
        ),
    ),
    (
        "seams",
        frozenset(
            {
                "stores._base",
                "stores._memory",
                "_tools",
                "_agent",
                "_hub",
                "_subscription",
                "_pending",
                "_nesting",
                "_reading",
                "_telemetry",
            }
        ),
    ),
    ("one session", frozenset({"_journal", "_tool_calls", "_actor", "_supervisor"})),
    ("many sessions", frozenset({"_ref", "_router", "_sessions", "_dispatch", "_registry"})),
)

#: Plug-ins: stores other than memory, the multi-worker layer, models, the test
#: kit, the asyncio host, the HTTP gateway and the command line.
PLUGINS: tuple[str, ...] = (
    "stores._sqlite",
    "stores._sqlite_files",
    "stores._redis",
    "stores._redis_connect",
    "stores._redis_transport",
    "stores._resp",
    "stores._url",
    "workers",
    "models",
    "testing",
    "aio",
    "http",
    "otel",
    "_cli",
    "_cli_given",
    "_cli_sessions",
    "_cli_copy",
    "_demo",
    "_demo_cluster",
    "__main__",
)

#: Public faces: they only re-export, and may name anything.
FACES = frozenset({"", "stores", "models", "testing", "workers", "aio", "http", "otel"})


def _rank(module: str) -> int | None:
    """The module's core layer (0 = values), len(LAYERS) for a plug-in, None if unknown."""
    for rank, (_, members) in enumerate(LAYERS):
        if module in members:
            return rank
    if any(module == p or module.startswith(p + ".") for p in PLUGINS):
        return len(LAYERS)
    return None


def _modules(root: Path) -> Iterator[tuple[str, Path]]:
    base = root / PACKAGE
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imports(module: str, path: Path, known: Container[str]) -> Iterator[tuple[str, int]]:
    """The package modules that ``module`` imports (relative to the package), with lines."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if module else []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield alias.name[len(PACKAGE) + 1 :], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = here if is_package else here[:-1]
                up = node.level - 1
                anchor = anchor[: len(anchor) - up] if up else anchor
                target = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                target = node.module[len(PACKAGE) + 1 :]
            else:
                continue
            # ``from . import x`` / ``from .stores import _sqlite`` name modules too
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                yield (sub if sub in known else target), node.lineno


def breaches(root: Path) -> list[str]:
    """Every breach of the layer rule in the package under ``root``."""
    found: list[str] = []
    modules = dict(_modules(root))
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        if module in FACES:
            continue
        rank = _rank(module)
        if rank is None:
            found.append(
                f"{module}: no layer; add it to LAYERS or PLUGINS in tests/check_layers.py"
            )
            continue
        for target, line in _imports(module, path, modules):
            # a face re-exports plug-ins (``sa.SQLiteStore``): importing one counts as a plug-in
            target_rank = len(LAYERS) if target in FACES else _rank(target)
            if target_rank is None:
                continue  # reported on its own
            graph[module].add(target)
            if rank < len(LAYERS) and target_rank > rank:
                what = (
                    "a plug-in"
                    if target_rank == len(LAYERS)
                    else f"layer {LAYERS[target_rank][0]!r}"
                )
                found.append(
                    f"{path.relative_to(root)}:{line}: {module} (layer {LAYERS[rank][0]!r}) "
                    f"imports {target or PACKAGE} ({what})"
                )
    found.extend(_cycles(graph))
    return list(dict.fromkeys(found))


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per import cycle (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[str] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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
            if len(component) > 1 or v in graph.get(v, ()):
                out.append("import cycle: " + " -> ".join(sorted(component)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    found = breaches(root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} breach(es) of the layer rule (DESIGN section 2)")
        return 1
    print(f"layers: {len(dict(_modules(root)))} modules, no breach")
    return 0


if __name__ == "__main__":
    sys.exit(main())
