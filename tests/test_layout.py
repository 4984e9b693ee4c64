"""The package's layout rules, checked on the source: every module imports here (the GPU ones too, their GPU
libraries imported lazily), imports form no cycle, no module imports another's `_private` names, and the
layers below the daemon never import it.

The import graph is read from the source (ast), function-level imports included, `if TYPE_CHECKING:` blocks
left out (they never run).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import stream

PACKAGE = Path(stream.__file__).resolve().parent
LOWER = ("stream.core", "stream.sources", "stream.engines", "stream.sinks", "stream.tools")  # never import the daemon
PUBLIC = (
    "stream",
    "stream.api",
    "stream.client",
    "stream.messages",
    "stream.errors",
    "stream.config",
    "stream.testing",
    "stream.sample",
)


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    if hasattr(inner, "lineno"):
                        lines.add(inner.lineno)
    return lines


def imports_of(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for each stream import of a module."""
    return imports_in(path.read_text(), name, path.name == "__init__.py")


def imports_in(
    source: str, name: str, is_package: bool = False, known: set[str] | None = None
) -> list[tuple[str, list[str], int]]:
    known = set(modules()) | (known or set())
    tree = ast.parse(source)
    skip = _type_checking_lines(tree)
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "stream"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "stream":
                continue
            names = [a.name for a in node.names]
            # `from stream.core import runner` imports the module stream.core.runner
            subs = [n for n in names if f"{mod}.{n}" in known]
            out += [(f"{mod}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest:
                out.append((mod, rest, node.lineno))
    return out


def graph(extra: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the stream modules it imports; `extra` adds made-up modules (name -> source)."""
    mods = modules()
    g = {name: {m for m, _, _ in imports_of(name, path) if m in mods and m != name} for name, path in mods.items()}
    for name, source in (extra or {}).items():
        g[name] = {
            m for m, _, _ in imports_in(source, name, known=set(extra)) if (m in mods or m in extra) and m != name
        }
    return g


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        path.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def private_imports(name: str, found: list[tuple[str, list[str], int]]) -> list[str]:
    return [
        f"{name}:{line} imports {n} from {mod}"
        for mod, names, line in found
        for n in names
        if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
    ]


def daemon_imports(name: str, found: list[tuple[str, list[str], int]]) -> list[str]:
    if not name.startswith(LOWER) and name not in PUBLIC:
        return []
    return [
        f"{name}:{line} imports {mod}"
        for mod, _, line in found
        if mod == "stream.daemon" or mod.startswith("stream.daemon.")
    ]


@pytest.mark.parametrize("name", [m for m in modules() if not m.endswith("__main__")])
def test_every_module_imports_without_a_gpu(name: str) -> None:
    importlib.import_module(name)


def test_walk_packages_finds_the_same_modules() -> None:
    walked = {m.name for m in pkgutil.walk_packages(stream.__path__, "stream.")} | {"stream"}
    assert walked == set(modules())


def test_no_import_cycles() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_private_names_imported_across_modules() -> None:
    found = [line for name, path in modules().items() for line in private_imports(name, imports_of(name, path))]
    assert not found, "\n".join(found)


def test_lower_layers_never_import_the_daemon() -> None:
    found = [line for name, path in modules().items() for line in daemon_imports(name, imports_of(name, path))]
    assert not found, "\n".join(found)


def test_the_rules_catch_a_breach() -> None:
    """Made-up modules breaking each rule are caught: a cycle through a function-level import, a private name,
    a lower layer importing the daemon; a TYPE_CHECKING import is not an edge."""
    fake = {
        "stream.core.fake_a": "def f():\n    from stream.core.fake_b import g\n",
        "stream.core.fake_b": "from stream.core import fake_a\n",
    }
    assert find_cycle(graph(fake)) in (
        ["stream.core.fake_a", "stream.core.fake_b", "stream.core.fake_a"],
        ["stream.core.fake_b", "stream.core.fake_a", "stream.core.fake_b"],
    )
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stream.core.fake_a import x\n"
    assert find_cycle(graph({**fake, "stream.core.fake_b": guarded})) is None
    src = "from stream.daemon.cli import _helper\n"
    assert private_imports("stream.sinks.fake", imports_in(src, "stream.sinks.fake")) == [
        "stream.sinks.fake:1 imports _helper from stream.daemon.cli"
    ]
    assert daemon_imports("stream.sinks.fake", imports_in(src, "stream.sinks.fake")) == [
        "stream.sinks.fake:1 imports stream.daemon.cli"
    ]
    assert daemon_imports("stream.daemon.fake", imports_in(src, "stream.daemon.fake")) == []


def test_public_surface_declares_all() -> None:
    for name in PUBLIC:
        mod = importlib.import_module(name)
        assert isinstance(getattr(mod, "__all__", None), list), f"{name} has no __all__"
        for attr in mod.__all__:
            assert hasattr(mod, attr), f"{name}.__all__ names {attr}, which it does not define"
