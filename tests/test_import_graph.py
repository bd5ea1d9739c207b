"""The static imports of ``dsp_plugin/`` form no cycle, between modules and between packages, and point down.

Every module of the package is parsed (``ast``, nothing imported) and each import
becomes an edge, at module level and inside functions alike:

* ``import a.b.c`` -> ``a.b.c``;
* ``from a.b import n`` -> ``a.b.n`` when that is a module of the package, else ``a.b``;
* relative imports (``from . import n``, ``from ..x import n``) resolved against the module's package.

Left out, since they never run (``if TYPE_CHECKING:``) or cannot be read statically
(``importlib.import_module(f"...")``, ``"module:function"`` strings): typing-only and
dynamic imports. A package's ``__init__`` is not an edge of its submodules' imports
(Python runs it first, but a submodule that imports its parent's names says so with
``from package import name``, which is an edge).

A cycle is reported as the modules in order, first module repeated at the end.

Packages (and the package's top-level modules) stand in layers, each importing only its own layer or
those below (``LAYERS``): the tools on top (the launches, the benches, the dry run, the plan checker and
the tiny models they share), then the samplers (``pipelines``), then the adapters, then the plan
runtime, the integrations and the head switch, then ``comm`` and the core modules. The package's face
(``dsp_plugin/__init__.py``) is the one exception: it re-exports from below.

No module is over ``MAX_LINES`` lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dsp_plugin

PACKAGE = Path(dsp_plugin.__file__).parent
ROOT = PACKAGE.name


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package`` (``__init__`` as the package's name)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` (at ``path``) imports statically, anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _typing_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    edges.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    edges.add(f"{source}.{alias.name}")
                elif source in known:
                    edges.add(source)
    edges.discard(name)
    return edges


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(package)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_in(graph, set(c)) for c in sorted(components)]


def _path_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth-first inside the component)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_package_imports_form_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the scan found too few modules or imports"
    found = cycles(graph)
    assert found == [], "import cycles in dsp_plugin/:\n" + "\n".join(" -> ".join(c) for c in found)


#: layer of each package or top-level module of dsp_plugin/ (a higher layer imports from its own or lower ones)
TOOLS, SAMPLERS, ADAPTERS, LIBRARY, CORE = 4, 3, 2, 1, 0
LAYERS = {
    **dict.fromkeys(("launch", "bench", "dryrun", "check", "testing"), TOOLS),
    "pipelines": SAMPLERS,
    "adapters": ADAPTERS,
    **dict.fromkeys(("plan", "megatron", "deepspeed", "head_switch", "baselines", "models", "fsdp"), LIBRARY),
}


def unit(module: str) -> str | None:
    """The package (or top-level module) of ``dsp_plugin`` a module belongs to; None for the package's face."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for name, imported in graph.items():
        source = unit(name)
        if source is None:
            continue
        units.setdefault(source, set()).update(u for u in map(unit, imported) if u not in (None, source))
    return units


def test_the_packages_form_no_cycle_and_import_down() -> None:
    graph = import_graph()
    units = package_graph(graph)
    found = cycles(units)
    assert found == [], "import cycles between packages of dsp_plugin/:\n" + "\n".join(" -> ".join(c) for c in found)
    upward = sorted(f"{a} (layer {LAYERS.get(a, CORE)}) imports {b} (layer {LAYERS.get(b, CORE)}): "
                    + ", ".join(sorted(f"{m} -> {t}" for m in graph if unit(m) == a for t in graph[m] if unit(t) == b))
                    for a, targets in units.items() for b in targets if LAYERS.get(b, CORE) > LAYERS.get(a, CORE))
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)
    assert all(name in units for name in LAYERS), sorted(set(LAYERS) - set(units))   # no stale names


def test_the_scan_finds_function_level_relative_and_submodule_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")                      # a submodule by `from`
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")      # function-level, relative
    (pkg / "sub" / "c.py").write_text("from ..a import name\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    import pkg.d\n")  # a name of a module; typing only
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]


#: the most lines a module of ``dsp_plugin/`` may hold: a longer one is split by what its parts do
MAX_LINES = 500


def test_no_module_is_over_the_line_limit() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by what their parts do): {long}"


def test_the_megatron_launch_module_imports_no_framework() -> None:
    """``python -m dsp_plugin.launch.pretrain_stdit`` is the module multiprocessing's spawn imports again
    (``__mp_main__``) in every process Megatron starts that way: the result-queue Manager of its first torch_dist
    save, one per rank. Importing it loads neither megatron nor diffusers nor DeepSpeed (the launch imports them
    in ``main()``): a Manager that re-imported them cost 7 s of CPU per rank, 13 s of a 4-rank launch's first save
    on 2 cores."""
    import subprocess
    import sys

    code = ("import sys, dsp_plugin.launch.pretrain_stdit; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'diffusers', 'deepspeed'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
