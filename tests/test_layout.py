"""The package reads top-down: entry points -> engine -> scheduling/execution -> models, with
config, sampling, outputs and updates at the bottom. Checked on the source (``ast``), without
importing anything.

Module-level imports are the ones Python runs when a module loads; imports under
``if TYPE_CHECKING:`` and inside functions are left out of the cycle check (they never run at
load time), but the bottom modules may not name an upper layer anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rltserve"
BOTTOM = ("rltserve.config", "rltserve.sampling", "rltserve.outputs", "rltserve.updates")
UPPER = ("rltserve.core", "rltserve.http", "rltserve.llm", "rltserve.cli", "rltserve.bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], everywhere: bool):
    """Import statements of ``body``: at module level only (the ``else`` of ``if TYPE_CHECKING``
    counts, its body does not), or with ``everywhere`` every import in the tree."""
    if everywhere:
        for stmt in body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    yield node
        return
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_nodes(node.body, False)
            yield from _import_nodes(node.orelse, False)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _import_nodes(block, False)


def _owning_module(name: str) -> str | None:
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name if name in MODULES else None


def rltserve_imports(name: str, everywhere: bool = False) -> set[str]:
    """The rltserve modules that module ``name`` imports (``from pkg import module`` names the
    module; ``from module import name`` names the module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text()).body, everywhere):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            owner = _owning_module(target) if target.startswith("rltserve") else None
            if owner is not None and owner != name:
                found.add(owner)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_known_edges():
    # Guards the checker itself: a graph with no edges would have no cycles either.
    assert "rltserve.core.step" in rltserve_imports("rltserve.core.runner")
    assert "rltserve.engine_args" in rltserve_imports("rltserve.cli")
    assert "rltserve.bench.prefill" in rltserve_imports("rltserve.bench.offline", everywhere=True)


def test_no_import_cycles_among_rltserve_modules():
    graph = {name: rltserve_imports(name) for name in MODULES}
    assert import_cycles(graph) == []


def test_step_does_not_import_the_runner_even_for_type_checking():
    assert "rltserve.core.runner" not in rltserve_imports("rltserve.core.step", everywhere=True)


@pytest.mark.parametrize(("lower", "upper"), [("rltserve.http.cli", "rltserve.cli")])
def test_the_server_cli_does_not_import_the_main_cli(lower, upper):
    assert upper not in rltserve_imports(lower, everywhere=True)


@pytest.mark.parametrize("name", BOTTOM)
def test_bottom_modules_import_no_upper_layer(name):
    upward = {
        m
        for m in rltserve_imports(name, everywhere=True)
        if any(m == u or m.startswith(u + ".") for u in UPPER)
    }
    assert upward == set()


def test_moved_names_keep_their_old_homes():
    from rltserve.core import kv_cache, request
    from rltserve.kv_policy import KVPolicy
    from rltserve.updates import FinishReason

    assert kv_cache.KVPolicy is KVPolicy
    assert request.FinishReason is FinishReason


def test_the_schedulers_side_imports_no_torch():
    """The scheduler, the KV manager and what they plan with load without torch (they are tested
    in milliseconds with hand-built results): a fresh interpreter imports them all and torch
    stays unloaded."""
    import subprocess
    import sys

    modules = ", ".join(
        f"rltserve.core.{name}"
        for name in (
            "scheduler",
            "kv_cache",
            "prefix_cache",
            "prompt_sharing",
            "preemption",
            "admission",
            "plan",
            "request",
            "swap",
            "standing",
            "work_items",
            "applier",
            "wavefront",
        )
    )
    code = f"import sys, {modules}; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
