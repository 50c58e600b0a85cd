"""The shape of the house (docs/design.md, "Layout"): every import of moremoe points down,
there is no import cycle, and no source file is over 500 lines. Imports inside functions
count as much as those at the top of a file."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moremoe"

# Lower layers never import higher ones. Within the application layer: tasks <- hf,
# parallel <- eval, bench <- training (<- phonebook, study); cli is on top. runtime imports nothing of moremoe.
LAYER = {"runtime": 0, "checks": 1, "accounting": 1, "report": 1,
         "kernels": 2, "ops": 3, "nn": 4, "model": 5,
         "tasks": 6, "hf": 7, "parallel": 7, "eval": 8, "bench": 8, "training": 9, "phonebook": 9, "study": 9,
         "cli": 10, "__init__": 11, "__main__": 11}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(name: str, path: Path, modules) -> set[str]:
    """moremoe modules that `name` imports (a package's submodule when it names one)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("moremoe")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("moremoe"):
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            found |= subs or {target}
    return found - {name}


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    return LAYER[part]


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_import_points_down():
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in _graph().items() for b in targets
              if _layer(b) > _layer(a)]
    assert not upward, "\n".join(sorted(upward))


def test_runtime_imports_nothing_of_moremoe():
    assert not _graph()["moremoe.runtime"]


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package's __init__ that re-exports its own modules is not a cycle of code
    real = [c for c in cycles if not all(m.startswith(c.split(" -> ")[0]) for m in c.split(" -> "))]
    assert not real, "\n".join(real)


def test_no_file_over_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_package_has_a_layer():
    tops = {p.name if p.is_dir() else p.stem for p in SRC.iterdir()
            if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")}
    tops -= {"assets"}
    missing = [t for t in tops if t not in LAYER]
    assert not missing, missing
