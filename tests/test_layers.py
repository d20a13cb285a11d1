"""The layers of the tree, held by walking its import graph (every import statement, lazy ones in functions
included; only `if TYPE_CHECKING:` blocks, which never run, are left out).

- tokenizer_service.core, the serving core, imports nothing of the HTTP edge (tokenizer_service.http)
  nor of fastapi, starlette, uvicorn;
- client imports nothing of app (it is what a training job installs: numpy and httpx);
- a worker process (what tokenizer_service.core.process imports, the entry point of the server's workers and of the
  pre-tokenizer's pool) never imports httpx;
- no import cycle anywhere in app/, client/ and bench/.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder in the checkout -> the name it is installed and imported as (pyproject: package-dir)
IMPORT_NAMES = {"app": "tokenizer_service", "client": "tokenizer_client", "bench": "bench"}
PACKAGES = tuple(IMPORT_NAMES.values())


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = IMPORT_NAMES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    found = (path for folder in IMPORT_NAMES for path in sorted((ROOT / folder).rglob("*.py")))
    return {module_name(path): path for path in found if "results" not in path.parts}  # bench/results: git-ignored


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, *, eager_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run: module level ones, and (unless eager_only) those inside functions."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            yield from _imports(ast.Module(body=node.orelse, type_ignores=[]), eager_only=eager_only)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and eager_only:
            continue
        else:
            yield from _imports(node, eager_only=eager_only)


@cache
def imports(module: str, *, eager_only: bool = False) -> frozenset[str]:
    """What `module` imports: project modules by their full name, anything else by its top-level name."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path)), eager_only=eager_only):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in modules() else base)
    return frozenset(name if name in modules() else name.split(".")[0] for name in found)


def _ancestors(module: str) -> Iterator[str]:
    parts = module.split(".")
    for end in range(1, len(parts)):
        yield ".".join(parts[:end])


def reach(seeds: Iterable[str]) -> set[str]:
    """Everything importing `seeds` may import: lazy imports followed, and each package's own module-level
    imports (importing a.b runs a/__init__.py first)."""
    seen: set[str] = set()
    todo = [(seed, False) for seed in seeds]
    while todo:
        module, eager_only = todo.pop()
        key = module if not eager_only else f"{module}!eager"
        if key in seen or module in seen:
            continue
        seen.add(key)
        if module not in modules():
            continue
        todo.extend((parent, True) for parent in _ancestors(module))
        todo.extend((target, False) for target in imports(module, eager_only=eager_only))
    return {key.removesuffix("!eager") for key in seen}


def _under(names: Iterable[str], prefix: str) -> list[str]:
    return sorted(name for name in names if name == prefix or name.startswith(f"{prefix}."))


def test_the_graph_is_read():
    """The walker finds what it must, or the rules below would hold vacuously."""
    assert {
        "tokenizer_service.core.handler",
        "tokenizer_service.http.edge",
        "tokenizer_client.wire",
        "tokenizer_service.tools.pretokenize.run",
    } <= set(modules())
    assert "tokenizer_service.core.handler" in imports("tokenizer_service.core.process")
    assert "fastapi" in imports("tokenizer_service.http.factory")
    assert "httpx" in reach(["tokenizer_client"])


def test_the_core_knows_nothing_of_http():
    core = _under(modules(), "tokenizer_service.core")
    reached = reach(core)
    assert _under(reached, "tokenizer_service.http") == []
    assert {"fastapi", "starlette", "uvicorn"} & reached == set()


def test_the_client_imports_nothing_of_the_server():
    assert _under(reach(_under(modules(), "tokenizer_client")), "tokenizer_service") == []


def test_worker_processes_do_not_import_httpx():
    reached = reach(["tokenizer_service.core.process"])
    assert "tokenizer_service.core.handler" in reached
    assert "httpx" not in reached
    assert _under(reached, "tokenizer_service.http") == []


def eager_reach(seeds: Iterable[str]) -> set[str]:
    """What importing `seeds` imports at once: module-level imports only (and each package's own)."""
    seen: set[str] = set()
    todo = list(seeds)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        if module in modules():
            todo.extend(_ancestors(module))
            todo.extend(imports(module, eager_only=True))
    return seen


def test_the_pre_tokenizer_starts_without_pydantic_or_tqdm():
    """pydantic (the server's request schemas and settings) is 0.14 s of a run's start, tqdm 0.04 s: the command
    imports neither at start (a model named, not a path, imports the server's settings then; a bar, tqdm)."""
    reached = eager_reach(["tokenizer_service.tools.pretokenize.cli"])
    assert {"tokenizer_service.core.process", "tokenizer_service.tools.pretokenize.run", "numpy"} <= reached
    assert {"pydantic", "pydantic_core", "pydantic_settings", "tqdm", "fastapi"} & reached == set()
    assert {"tokenizer_service.settings", "tokenizer_service.core.requests", "tokenizer_service.core.handler"} & (
        reached
    ) == set()


def test_tokenizer_shards_starts_without_the_model_code_or_tqdm():
    """info, merge and export read shards: no tokenizer library, no server, no tqdm at start (export -q, the
    second command of every pre-tokenize-then-export run, never imports it)."""
    reached = eager_reach(["tokenizer_service.tools.pretokenize.shards_cli"])
    assert {"tokenizer_service.tools.pretokenize.export", "tokenizer_client.dataset", "numpy"} <= reached
    assert {"tqdm", "pydantic", "tokenizers", "sentencepiece", "tiktoken", "tokenizer_service.core.libraries"} & (
        reached
    ) == set()


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1 or module in graph[module]:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_the_cycle_finder_finds_cycles():
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["e"], "f": ["d"]}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e"]]


def test_no_import_cycles():
    graph = {module: sorted(name for name in imports(module) if name in modules()) for module in modules()}
    assert cycles(graph) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_walked(package):
    assert len(_under(modules(), package)) > 5
