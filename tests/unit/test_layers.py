"""The package's layers, as ``docs/architecture.md`` states them: a module imports only modules of
its own layer or below, and no import (type-only ones included) closes a circle."""
import ast
import graphlib
import pathlib

import horovod_safusion

ROOT = pathlib.Path(horovod_safusion.__file__).parent
PACKAGE = ROOT.name

#: Lowest first. A name stands for the module and, for a package, every module in it.
LAYERS = (
    ("foundation", ("announce", "registry", "requirements", "checkpoint", "clock", "cycle", "launcher", "segment", "wire", "plan", "density", "residual", "observer", "session", "options",
                    "timeline.trace")),
    ("kernels", ("kernels",)),
    ("algorithms", ("compressors", "fusion", "momentum", "spread", "warmup", "regime")),
    ("communicators", ("communicators",)),
    ("runtime", ("buffer", "stages", "controller", "sweeps", "trial", "profiling", "timeline")),
    ("interface", ("optimizer", "assembly", "joining", "elastic", "__main__", "doctor", "")),
)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split(".")) if name else ROOT
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports() -> dict[str, set[str]]:
    """Every module's imports of this package's modules (package-relative names, '' = the package)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        name = module_name(path)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = [p for p in package if p]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - node.level + 1] + ([node.module] if node.module else [])
                elif node.module and node.module.split(".")[0] == PACKAGE:
                    base = node.module.split(".")[1:]
                else:
                    continue
                target = ".".join(base)
                for alias in node.names:  # "from . import x" imports module x
                    sub = f"{target}.{alias.name}" if target else alias.name
                    found.add(sub if exists(sub) else target)
            elif isinstance(node, ast.Import):
                found |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == PACKAGE}
        graph[name] = found - {name}
    return graph


def layer_of(name: str) -> int:
    best, depth = None, -1
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if (name == m or (m and name.startswith(m + "."))) and len(m) > depth:
                best, depth = i, len(m)
    assert best is not None, f"module {name!r} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


def test_every_module_imports_only_its_own_layer_or_below():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in imports().items() for d in deps
              if not d.startswith(m + ".") and layer_of(d) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    graph = imports()
    # a package's __init__ re-exports its modules: an edge package -> own module is no circle
    graph = {m: {d for d in deps if not (m == "" or d.startswith(m + "."))} for m, deps in graph.items()}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError with the circle


def test_the_planning_package_needs_no_runtime():
    planning = {m: deps for m, deps in imports().items() if m == "fusion" or m.startswith("fusion.")}
    assert planning
    for m, deps in planning.items():
        assert all(d in ("plan", "density", "registry") or d.startswith("fusion") for d in deps), (m, deps)


def test_the_algorithms_import_no_runtime_state():
    """The planners and the compressors are data in, data out: they import nothing of the runtime
    (no buffer, controller, stage or profiler), so they hold no state that the runtime writes."""
    for m, deps in imports().items():
        if m.split(".")[0] in ("fusion", "compressors"):
            assert not [d for d in deps if layer_of(d) >= layer_of("buffer")], (m, deps)


#: The longest function body (its docstring aside) in the modules a newcomer reads first.
MAX_FUNCTION_LINES = 60


def test_the_step_path_reads_in_short_functions():
    long = []
    for path in [ROOT / "controller.py", ROOT / "optimizer.py", *sorted((ROOT / "stages").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                docstring = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                start = body[1].lineno if docstring and len(body) > 1 else node.lineno
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - start + 1} lines")
    assert not long, "\n".join(long)
