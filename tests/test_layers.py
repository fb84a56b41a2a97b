"""The package's layers, read from its source: imports flow one way (docs/architecture.md).

Every import counts, those inside functions and under TYPE_CHECKING too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's package-dir: the design card's top-level folders install as one package
PACKAGE_DIRS = {
    "tritonllm": ROOT / "backend",
    "tritonllm.lora": ROOT / "lora",
    "tritonllm.spec_decode": ROOT / "spec_decode",
}
COMMANDS = "tritonllm.commands"
TRAINING = "tritonllm.spec_decode.training"  # allowed to drive the engine, one way
ENTRY_POINTS = {"tritonllm.__main__"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if "__pycache__" in parts or (package == "tritonllm" and parts[0] in ("lora", "spec_decode")):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            if node.level:
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            submodules = [f"{source}.{alias.name}" for alias in node.names]
            names.update(name for name in submodules if name in modules)
            if any(name not in modules for name in submodules):
                names.add(source)  # names the module (or the package's __init__) defines
    targets = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            targets.add(name)
    return targets


@lru_cache(maxsize=1)
def import_graph() -> dict[str, frozenset[str]]:
    modules = _modules()
    return {module: frozenset(_imported(module, path, modules)) for module, path in modules.items()}


def _cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                    found.append(sorted(component))
    return found


def area(module: str) -> str:
    """The package a module belongs to, for the package-level rule: tritonllm.<first part>, with training apart."""
    if module == TRAINING or module.startswith(TRAINING + "."):
        return TRAINING
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_no_file_imports_itself_through_others():
    assert _cycles(import_graph()) == []


def test_no_package_imports_itself_through_others():
    areas: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if area(module) in (COMMANDS, TRAINING) or module in ENTRY_POINTS:
            continue  # commands sit on top; training may import the engine (nothing imports it back)
        areas.setdefault(area(module), set()).update(area(t) for t in targets if area(t) != area(module))
    assert _cycles({name: frozenset(targets) for name, targets in areas.items()}) == []


def test_the_tensorrt_llm_adapter_imports_nothing_of_the_embedded_engine():
    adapter = [m for m in import_graph() if m.startswith("tritonllm.engine.trtllm")]
    assert adapter
    reached = _reachable(adapter)
    assert sorted(m for m in reached if m.startswith("tritonllm.engine.embedded")) == []


def test_no_library_module_imports_a_command():
    offenders = [
        (module, target)
        for module, targets in import_graph().items()
        if area(module) != COMMANDS and module not in ENTRY_POINTS
        for target in targets
        if area(target) == COMMANDS
    ]
    assert offenders == []


def test_the_engine_imports_nothing_of_the_triton_side_or_training():
    upward = ("tritonllm.triton", "tritonllm.bls", "tritonllm.models", "tritonllm.openai_api", TRAINING)
    offenders = [
        (module, target)
        for module, targets in import_graph().items()
        if area(module) == "tritonllm.engine"
        for target in targets
        if area(target) in upward
    ]
    assert offenders == []


def test_the_speculative_decoding_algorithms_import_nothing_of_the_engine():
    offenders = [
        (module, target)
        for module, targets in import_graph().items()
        if area(module) == "tritonllm.spec_decode"
        for target in targets
        if area(target) == "tritonllm.engine"
    ]
    assert offenders == []


def test_the_graph_is_read_from_real_imports():
    """Guards the reader itself: a known import is seen, and each rule's subjects exist."""
    graph = import_graph()
    assert "tritonllm.engine.seam" in graph["tritonllm.engine.embedded.engine"]
    assert "tritonllm.commands.main" in graph
    assert any(m.startswith("tritonllm.spec_decode.") for m in graph)


def _reachable(starts: list[str]) -> set[str]:
    graph, seen, todo = import_graph(), set(), list(starts)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen
