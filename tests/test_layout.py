"""The layout shows the architecture: no import cycle inside zoo (counting every import statement: at the top,
inside functions and under TYPE_CHECKING), the sub-packages depend on each other in one direction, and no file of
zoo/, recipes/ or convert/ outgrows a few screens unless it does one job (named here)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400
ONE_JOB: dict[str, str] = {  # files allowed past MAX_LINES, and the one job each does
    "zoo/models/llava.py": "the LLaVA family: the model, its image splicing and the checkpoint layouts it reads "
                           "(llava-hf, transformers 5, the original repository)",
}
# which zoo sub-package may import which: core at the bottom, then models, then I/O, training aids, generation and
# parallelism; zoo/__init__ and __main__ (the public surface) above all
LAYERS = {
    "zoo.errors": set(),
    "zoo.core": {"zoo.errors"},
    "zoo.models": {"zoo.errors", "zoo.core"},
    "zoo.io": {"zoo.errors", "zoo.core", "zoo.models"},
    "zoo.train": {"zoo.errors", "zoo.core", "zoo.models"},
    "zoo.parallel": {"zoo.errors", "zoo.core"},
    "zoo.generate": {"zoo.errors", "zoo.core", "zoo.models", "zoo.io"},
}


def modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "zoo").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The zoo modules `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zoo":
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "zoo"]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
                break
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> str | None:
    return next((name for name in LAYERS if module == name or module.startswith(name + ".")), None)


def test_no_import_cycle_inside_zoo():
    found = cycles(graph())
    assert not found, f"import cycles: {found}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_sub_packages_import_downwards_only():
    wrong = []
    for module, targets in graph().items():
        own = layer(module)
        if own is None:  # zoo, zoo.__main__: the public surface may import anything
            continue
        for target in targets:
            other = layer(target)
            if other is not None and other != own and other not in LAYERS[own]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_files_fit_a_few_screens():
    long = []
    for folder in ("zoo", "recipes", "convert"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            n = len(path.read_text().splitlines())
            if n > MAX_LINES and name not in ONE_JOB:
                long.append(f"{name}: {n} lines")
    assert not long, "files over ~400 lines that do more than one job:\n" + "\n".join(long)
