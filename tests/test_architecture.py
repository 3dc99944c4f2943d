"""The package's shape (docs: DESIGN's layers), read from its source with :mod:`ast`.

* No import cycle between the package's modules (top-level and function-local imports).
* No function-local import of a package module (one that exists to dodge a cycle hides it).
* No private or lowering API of JAX or Optax: ``jax._src``, ``jax.interpreters``,
  ``jax.extend``, ``jaxlib``, ``optax._src`` (imported, or reached as an attribute).
* The core (``_src``, ``__init__``, ``diagnostics``, ``contrib``) imports the standard library,
  numpy, jax, optax, chex and its own modules only.
* Every name in the public modules' ``__all__`` exists.

The checkers are plain functions of a parsed package; the ``test_checker_*`` tests run each
one on a small synthetic package with the violation written in, so each check can fail.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import sys
import textwrap
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "optax_decoupled"

#: Module prefixes that are private or lowering internals of JAX and Optax.
FORBIDDEN = ("jax._src", "jax.interpreters", "jax.extend", "jaxlib", "optax._src")
#: What the core may import besides the standard library and itself.
CORE_DEPENDENCIES = frozenset({"numpy", "jax", "optax", "chex"})
#: The core: these modules and everything under these packages.
CORE = ("optax_decoupled", "optax_decoupled._src", "optax_decoupled.contrib",
        "optax_decoupled.diagnostics")  # fmt: skip
PUBLIC = ("optax_decoupled", "optax_decoupled.contrib", "optax_decoupled.diagnostics")


@dataclasses.dataclass(frozen=True)
class Module:
    name: str
    path: pathlib.Path
    is_package: bool
    tree: ast.Module


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module named, absolute (for `from X import a`: X.a if that is a module)
    where: str  # path:line
    local: bool  # inside a function (or lambda)
    type_checking: bool  # under `if TYPE_CHECKING:` (never runs)


def parse_package(root: pathlib.Path, package: str) -> dict[str, Module]:
    """Every ``.py`` file of the package under ``root``, by dotted module name."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        modules[name] = Module(name, path.relative_to(root), is_package, tree)
    return modules


def _resolve(module: Module, level: int, name: str | None) -> str:
    """The absolute module of ``from <level dots><name> import ...`` in ``module``."""
    if level == 0:
        return name or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: Module, modules: dict[str, Module]) -> list[Import]:
    """Every import statement of ``module``, with its place and context."""
    found = []

    def visit(node, local, type_checking):
        for child in ast.iter_child_nodes(node):
            where = f"{module.path}:{getattr(child, 'lineno', '?')}"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module.name, alias.name, where, local, type_checking))
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, child.level, child.module)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in modules else base
                    found.append(Import(module.name, target, where, local, type_checking))
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            guarded = isinstance(child, ast.If) and _is_type_checking(child.test)
            if guarded:
                visit(ast.Module(body=child.body, type_ignores=[]), local, True)
                visit(ast.Module(body=child.orelse, type_ignores=[]), local, type_checking)
            else:
                visit(child, local or is_function, type_checking)

    visit(module.tree, False, False)
    return found


def _internal(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def import_graph(modules: dict[str, Module], package: str) -> dict[str, set[str]]:
    """Edges between the package's own modules (imports that run, wherever they are)."""
    graph = {name: set() for name in modules}
    for module in modules.values():
        for imp in imports_of(module, modules):
            if imp.type_checking or not _internal(imp.target, package):
                continue
            # `import a.b.c` names a.b.c; the closest module that exists is what it runs.
            target = imp.target
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module.name:
                graph[module.name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def local_package_imports(modules: dict[str, Module], package: str) -> list[str]:
    return [
        f"{imp.where}: {imp.module} imports {imp.target} inside a function"
        for module in modules.values()
        for imp in imports_of(module, modules)
        if imp.local and _internal(imp.target, package)
    ]


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _forbidden(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FORBIDDEN)


def private_api_uses(modules: dict[str, Module]) -> list[str]:
    """Imports of, and attribute chains into, :data:`FORBIDDEN` (through import aliases)."""
    problems = []
    for module in modules.values():
        aliases = {}  # local name -> module or attribute path it is bound to
        for node in ast.walk(module.tree):
            where = f"{module.path}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _forbidden(alias.name):
                        problems.append(f"{where}: import {alias.name}")
                    bound = alias.asname or alias.name.split(".")[0]
                    aliases[bound] = alias.name if alias.asname else bound
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if _forbidden(node.module) or _forbidden(full):
                        problems.append(f"{where}: from {node.module} import {alias.name}")
                    aliases[alias.asname or alias.name] = full

        def resolved(node):
            dotted = _dotted(node)
            if dotted is None:
                return ""
            head, _, rest = dotted.partition(".")
            return ".".join(filter(None, [aliases.get(head, head), rest]))

        for node in ast.walk(module.tree):
            # The innermost forbidden link of a chain (`jax._src` of `jax._src.core.x`).
            if isinstance(node, ast.Attribute) and _forbidden(full := resolved(node)):
                if not _forbidden(resolved(node.value)):
                    problems.append(f"{module.path}:{node.lineno}: uses {full}")
    return problems


def _in_core(name: str) -> bool:
    return name == CORE[0] or any(name == c or name.startswith(c + ".") for c in CORE[1:])


def foreign_core_imports(modules: dict[str, Module], package: str) -> list[str]:
    """Imports of the core that are neither the standard library, :data:`CORE_DEPENDENCIES`
    nor a core module."""
    allowed = set(sys.stdlib_module_names) | CORE_DEPENDENCIES
    problems = []
    for module in modules.values():
        if not _in_core(module.name):
            continue
        for imp in imports_of(module, modules):
            top = imp.target.split(".")[0]
            if _internal(imp.target, package):
                ok = _in_core(imp.target)
            else:
                ok = top in allowed
            if not ok:
                problems.append(f"{imp.where}: the core module {module.name} imports {imp.target}")
    return problems


def missing_exports(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        return [f"{module.__name__} has no __all__"]
    problems = [f"{module.__name__}.__all__ lists {n!r} twice" for n in set(names)
                if list(names).count(n) > 1]  # fmt: skip
    problems += [f"{module.__name__}.__all__ lists {n!r}, which it does not define"
                 for n in names if not hasattr(module, n)]  # fmt: skip
    return problems


# ---------------------------------------------------------------------------------------------
# The package
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package():
    return parse_package(ROOT, PACKAGE)


def test_the_package_is_parsed(package):
    assert {PACKAGE, f"{PACKAGE}._src.transforms", f"{PACKAGE}.contrib"} <= set(package)
    assert import_graph(package, PACKAGE)[PACKAGE], "the package's __init__ imports nothing?"


def test_no_import_cycle(package):
    cycle = find_cycle(import_graph(package, PACKAGE))
    assert cycle is None, " -> ".join(cycle)


def test_no_function_local_import_of_the_package(package):
    assert not local_package_imports(package, PACKAGE)


def test_no_private_jax_or_optax_api(package):
    assert not private_api_uses(package)


def test_the_core_imports_only_its_dependencies(package):
    assert not foreign_core_imports(package, PACKAGE)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_name_exists(name):
    assert not missing_exports(importlib.import_module(name))


# ---------------------------------------------------------------------------------------------
# The checkers on synthetic packages
# ---------------------------------------------------------------------------------------------


def _write(root: pathlib.Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return parse_package(root, "pkg")


CLEAN = {
    "pkg/__init__.py": "from pkg._src import a\nfrom pkg import contrib\n",
    "pkg/_src/__init__.py": "",
    "pkg/_src/a.py": "import functools\nimport jax.numpy as jnp\nfrom . import b\n",
    "pkg/_src/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
    "pkg/contrib/__init__.py": "from .._src.b import thing\n",
    "pkg/experiments/x.py": "import flax\nimport pkg\n",
}


def test_checker_passes_a_clean_package(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "CORE", ("pkg", "pkg._src", "pkg.contrib"))
    modules = _write(tmp_path, CLEAN)
    graph = import_graph(modules, "pkg")
    assert graph["pkg"] == {"pkg._src.a", "pkg.contrib"}
    assert graph["pkg._src.a"] == {"pkg._src.b"}  # relative import resolved
    assert graph["pkg.contrib"] == {"pkg._src.b"}
    assert graph["pkg._src.b"] == set()  # under TYPE_CHECKING: never runs
    assert find_cycle(graph) is None
    assert not local_package_imports(modules, "pkg")
    assert not private_api_uses(modules)
    assert not foreign_core_imports(modules, "pkg")  # flax is outside the core


@pytest.mark.parametrize("local", [False, True], ids=["top-level", "function-local"])
def test_checker_finds_a_cycle(tmp_path, local):
    back = "def f():\n    from pkg._src import a\n" if local else "from pkg._src import a\n"
    modules = _write(tmp_path, {**CLEAN, "pkg/_src/b.py": back})
    assert find_cycle(import_graph(modules, "pkg")) == ["pkg._src.a", "pkg._src.b", "pkg._src.a"]


def test_checker_finds_a_function_local_import(tmp_path):
    text = "import os\ndef f():\n    import json\n    from pkg._src import b\n    return b\n"
    modules = _write(tmp_path, {**CLEAN, "pkg/experiments/x.py": text})
    (problem,) = local_package_imports(modules, "pkg")
    assert "x.py:4" in problem and "pkg._src.b" in problem


@pytest.mark.parametrize(
    "text",
    [
        "from jax._src import xla_bridge\n",
        "import jax._src.core\n",
        "import jaxlib\n",
        "from jax import extend\n",
        "from optax._src import base\n",
        "import jax\nx = jax.interpreters.mlir\n",
        "import jax as j\ndef f():\n    return j._src.config\n",
        "import optax\nx = optax._src.base.GradientTransformation\n",
    ],
)
def test_checker_finds_private_api(tmp_path, text):
    modules = _write(tmp_path, {**CLEAN, "pkg/experiments/x.py": text})
    problems = private_api_uses(modules)
    assert len(problems) == 1 and "x.py" in problems[0], problems


@pytest.mark.parametrize(
    "path, text",
    [
        ("pkg/_src/a.py", "import flax\n"),
        ("pkg/_src/a.py", "def f():\n    import matplotlib.pyplot as plt\n"),
        ("pkg/contrib/__init__.py", "from pkg.experiments import x\n"),
        ("pkg/__init__.py", "import scipy\n"),
    ],
)
def test_checker_finds_a_foreign_core_import(tmp_path, monkeypatch, path, text):
    monkeypatch.setattr(sys.modules[__name__], "CORE", ("pkg", "pkg._src", "pkg.contrib"))
    modules = _write(tmp_path, {**CLEAN, path: text})
    (problem,) = foreign_core_imports(modules, "pkg")
    assert path in problem


def test_checker_finds_a_missing_export():
    module = types.ModuleType("fake")
    module.a = 1
    module.__all__ = ("a", "b", "a")
    assert missing_exports(module) == [
        "fake.__all__ lists 'a' twice",
        "fake.__all__ lists 'b', which it does not define",
    ]
    assert missing_exports(types.ModuleType("bare")) == ["bare has no __all__"]
