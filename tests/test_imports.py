"""jaxkv's modules form layers: following the imports (every one, at module level or inside a
function) never leads back to where it started."""

from __future__ import annotations

import ast
import pathlib

import jaxkv

ROOT = pathlib.Path(jaxkv.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = ("jaxkv",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The jaxkv modules that ``name`` imports (a package's ``__init__`` counts as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # `from . import x` names a module (here the compiled _jaxkv too): never the package
                found.add(sub if sub in known or node.module is None else base)
    return {m for m in found if m in known and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other in a loop, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_jaxkv_has_no_import_cycle():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    assert graph["jaxkv.linear"] >= {"jaxkv.sharding", "jaxkv._lifecycle"}  # the walk sees imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_cache_kinds_do_not_use_each_other_as_a_library():
    """Shared rules live below the cache kinds; a manager converts from and to a linear cache
    (``from_linear`` / ``to_linear``) and nothing else imports a cache kind's module."""
    mods = modules()
    kinds = {"jaxkv.linear", "jaxkv.manager", "jaxkv.paged"}
    for name in kinds | {"jaxkv.ops", "jaxkv.paged_ops", "jaxkv.reuse", "jaxkv.sharding",
                         "jaxkv._lifecycle"}:
        used = imports_of(name, mods[name], set(mods)) & kinds
        assert used <= ({"jaxkv.linear"} if name == "jaxkv.manager" else set()), (name, used)
