"""The layout shows the architecture: no import cycle anywhere in zoo/, recipes/ and convert/ (counting every import
statement: at the top, inside functions and under TYPE_CHECKING), the packages depend on each other in one
direction (recipes -> convert -> zoo; inside zoo its layers; inside recipes each recipe -> the engine -> reporting
and data), and no file of zoo/, recipes/ or convert/ outgrows a few screens unless it does one job (named here)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("zoo", "convert", "recipes")  # each may import those before it, never one after (bench/ and tests/: all)
MAX_LINES = 400
ONE_JOB: dict[str, str] = {  # files allowed past MAX_LINES, and the one job each does
    "zoo/models/presets.py": "the one registry of named models: each published shape, its source and its count",
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
# the shared parts of recipes/ and what each may import of the others; every other module of recipes/ belongs to a
# recipe (recipes.pretrain, recipes.dpo and its modules, ...), which may import these and its own modules, never
# another recipe's; recipes/__init__ imports none of them
SHARED = {
    "recipes.data": set(),
    "recipes.report": set(),
    "recipes.engine": {"recipes.data", "recipes.report"},
}

def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for folder in FOLDERS:
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(source: str, module: str, known: set[str], package: bool = False) -> set[str]:
    """The modules of `known` that the source of `module` imports, anywhere in it: at the top, inside functions,
    under TYPE_CHECKING, relative imports and importlib.import_module("...") of a literal name included. `from a
    import b` is a.b when that is a module, else a; a package's __init__, which Python runs before any module of
    it, counts only where it is named."""
    here = module if package else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            names.append(node.args[0].value)
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found - {module}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p.read_text(), m, set(known), p.name == "__init__.py") for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def a_cycle(edges: dict[str, set[str]], comp: list[str]) -> str:
    """One circle through a strongly connected component, as `a -> b -> a` (the shortest back to its first)."""
    start, inside = comp[0], set(comp)
    paths = {w: [start, w] for w in sorted(edges.get(start, set()) & inside)}
    queue = list(paths)
    while start not in paths:
        v = queue.pop(0)
        for w in sorted(edges.get(v, set()) & inside):
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return " -> ".join(paths[start])


def part(module: str) -> str:
    """The part of the architecture a module belongs to: a zoo layer, convert, a shared part of recipes or one
    recipe; zoo (and zoo.__main__) and recipes themselves."""
    if module.startswith("zoo."):
        return next((name for name in LAYERS if module == name or module.startswith(name + ".")), "zoo")
    if module.startswith("recipes."):
        return ".".join(module.split(".")[:2])
    return module.split(".")[0]


def allowed(own: str, other: str) -> bool:
    if own == other:
        return True
    own_folder, other_folder = own.split(".")[0], other.split(".")[0]
    if own_folder != other_folder:
        return FOLDERS.index(other_folder) < FOLDERS.index(own_folder)
    if own_folder == "zoo":
        return own == "zoo" or other in LAYERS[own]  # the public surface may import anything of zoo
    if own_folder == "recipes":
        return own != "recipes" and other in SHARED.get(own, set(SHARED))
    return True


def upward(edges: dict[str, set[str]]) -> list[str]:
    """The imports against the layering, as `module -> target`."""
    return sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets if not allowed(part(m), part(t)))


def test_no_import_cycle():
    edges = graph()
    found = [a_cycle(edges, comp) for comp in cycles(edges)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert a_cycle(edges, ["a", "b", "c"]) == "a -> b -> c -> a"
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_lazy_type_only_and_relative_imports_count():
    known = {"recipes.dpo", "recipes.dpo.config", "recipes.dpo.losses", "recipes.engine.processes", "zoo.core"}
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from recipes.dpo import DPOConfig\n"
              "def f():\n    from recipes.engine.processes import Dist\n    import zoo.core.attention\n"
              "from .losses import x\nfrom . import config\n")
    assert imports(source, "recipes.dpo.reference", known) == known
    assert imports("import importlib\nimportlib.import_module('zoo.core')\n", "recipes.x", known) == {"zoo.core"}


def test_the_layering_finds_an_upward_import():
    edges = {"zoo.core.attention": {"zoo.models.llama"}, "zoo.models.llama": {"zoo.core.attention"},
             "convert.common": {"recipes.engine.loop"}, "recipes.engine.loop": {"recipes.dpo", "recipes.data.packs",
                                                                                "convert.common", "zoo"},
             "recipes.sft": {"recipes.pretrain", "recipes.engine.loop"},
             "recipes.dpo.reference": {"recipes.dpo.config"}, "recipes.report.sample": {"recipes.engine.processes"},
             "zoo.io.load": {"recipes"}}
    assert upward(edges) == ["convert.common -> recipes.engine.loop", "recipes.engine.loop -> recipes.dpo",
                             "recipes.report.sample -> recipes.engine.processes", "recipes.sft -> recipes.pretrain",
                             "zoo.core.attention -> zoo.models.llama", "zoo.io.load -> recipes"]


def test_packages_import_downwards_only():
    wrong = upward(graph())
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_files_fit_a_few_screens():
    long = []
    for folder in ("zoo", "recipes", "convert"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            n = len(path.read_text().splitlines())
            if n > MAX_LINES and name not in ONE_JOB:
                long.append(f"{name}: {n} lines")
    assert not long, "files over ~400 lines that do more than one job:\n" + "\n".join(long)
