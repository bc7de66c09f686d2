"""The house rules the code keeps (checked on the source, no imports): modules of a readable size,
no private name taken from another module, and no import circle between neuron's modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("neuron", "protocol", "devtools")
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, [alias.name for alias in node.names]))
    return out


def test_no_module_is_longer_than_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_module_imports_a_private_name_of_another():
    ours = modules()
    bad = []
    for name, path in ours.items():
        for module, names in imports(name, path):
            if module.split(".")[0] in PACKAGES:
                bad += [f"{name}: {module}.{n}" for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, bad


def test_no_import_circle_between_modules():
    ours = modules()
    graph: dict[str, set[str]] = {}
    for name, path in ours.items():
        deps = set()
        for module, names in imports(name, path):
            for target in [f"{module}.{n}" for n in names] + [module]:
                if target in ours and target != name:
                    deps.add(target)
                    break
        graph[name] = deps
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not circles, circles


# Rooms a room must not reach: the models know tensors and weight sources, not files, engines or
# HTTP; the kernels know only tensors; the engine knows no HTTP side; the HTTP side reaches the
# engine only through protocol/engine_client.py (its one implementation chosen in server/app.py).
BELOW = {"neuron.models": ("neuron.loader", "neuron.engine", "neuron.server", "neuron.core", "neuron.runner"),
         "neuron.kernels": ("neuron.models", "neuron.loader", "neuron.engine", "neuron.server", "neuron.core",
                            "neuron.runner"),
         "neuron.engine": ("neuron.server", "neuron.core", "neuron.registry", "neuron.local_client"),
         "neuron.server": ("neuron.engine", "neuron.core", "neuron.registry", "neuron.model_handle", "neuron.rankgroup",
                           "neuron.rank", "neuron.runner", "neuron.models", "neuron.kernels")}


def test_the_lower_rooms_import_nothing_from_the_rooms_above_them():
    up = []
    for name, path in modules().items():
        for room, above in BELOW.items():
            if name == room or name.startswith(room + "."):
                up += [f"{name} -> {module}" for module, _ in imports(name, path)
                       if any(module == a or module.startswith(a + ".") for a in above)]
    assert not up, up
