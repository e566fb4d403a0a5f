"""The package's layout rules, checked on the source (no ranks, no kernel).

1. Import contract: rank-side code (`labkit.rank`, `labkit.wire`, `labkit.parallel`) never
   imports the notebook's packages (IPython, ipywidgets, plotly, anywidget, ipykernel,
   jupyter*) nor labkit's kernel-side packages (`labkit.kernel`, `labkit.views`,
   `labkit.exercises`, `labkit.tools`): read statically from every import statement, and
   checked dynamically by importing every rank-side module in one fresh interpreter.
2. No module in labkit/ is over 400 lines.
3. No import cycle among labkit's modules, through any import: at module level, inside a
   function, or for type hints only (`if TYPE_CHECKING:`).
4. Every module of `labkit.kernel`, `labkit.rank` and `labkit.wire` has a docstring.
5. Every Markdown file the code, tests, notebooks and docs cite is in the repo, and every
   labkit module the code, notebooks and docs cite by path.
6. `labkit.kernel`'s parts import one way: each module sits in one of `KERNEL_LAYERS` and
   imports kernel modules of its own layer or of lower ones only.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "labkit"
RANK_SIDE = ("labkit.rank", "labkit.wire", "labkit.parallel")
NOTEBOOK_PACKAGES = ("IPython", "ipywidgets", "plotly", "anywidget", "ipykernel")
KERNEL_SIDE = ("labkit.kernel", "labkit.views", "labkit.exercises", "labkit.tools")
DOCUMENTED = ("labkit.kernel", "labkit.rank", "labkit.wire")
MAX_LINES = 400

# labkit.kernel's parts, lowest first: a kernel module imports kernel modules of its own layer
# or of a lower one, never of a higher one (docs/layout.md says what each part does)
KERNEL_LAYERS: tuple[tuple[str, ...], ...] = (
    ("labkit.kernel.results",),  # what comes back, and the errors and warnings every part raises
    ("labkit.kernel.inspection",),  # stacks, pdb, Flight Recorder, profiling, logs: leaves
    ("labkit.kernel.channel",),  # the channel to the ranks and its transports
    ("labkit.kernel.launch",),  # how ranks come to exist, over a channel
    ("labkit.kernel.cell",),  # one cell's run over a launcher's channel
    ("labkit.kernel.lab", "labkit.kernel.lab_data", "labkit.kernel.script_run"),  # the Lab
    ("labkit.kernel.magics",),  # thin: parse, call the Lab, display
)


def _modules() -> dict[str, Path]:
    """Every module of labkit by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _forbidden(name: str) -> bool:
    """True for a module rank-side code must not import."""
    root = name.split(".")[0]
    return root in NOTEBOOK_PACKAGES or root.startswith("jupyter") or _under(name, KERNEL_SIDE)


def _lazy_names() -> dict[str, str]:
    """`labkit`'s lazily loaded names -> the module each comes from (`from labkit import Lab`)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return {}


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if not level:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _imported(node: ast.stmt, module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The modules an import statement written in `module` names (none for other statements).

    `from a import b` names `a.b` when that is a module, else `a` (and, for `from labkit
    import Lab`, the module `labkit` loads `Lab` from).
    """
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = _resolve(module, path.name == "__init__.py", node.level, node.module)
    lazy = _lazy_names() if base == "labkit" else {}
    names = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules or _forbidden(sub):
            names.append(sub)
        else:
            names.append(lazy.get(alias.name, base))
    return names


def _source(node: ast.stmt, path: Path) -> str:
    return ast.get_source_segment(path.read_text(), node) or ast.dump(node)


# -------------------------------------------------------------------- 1. the import contract


def test_rank_side_code_imports_nothing_of_the_notebook_or_the_kernel_side() -> None:
    modules = _modules()
    bad = []
    for module, path in modules.items():
        if not _under(module, RANK_SIDE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):  # inside functions too
            culprits = sorted({n for n in _imported(node, module, path, modules) if _forbidden(n)})
            if culprits:
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                bad.append(f"{where}: `{_source(node, path)}` imports {', '.join(culprits)}")
    assert not bad, (
        "rank-side code (labkit.rank, labkit.wire, labkit.parallel) must not import the "
        "notebook's packages or labkit's kernel side; move the code, or the import, to the "
        "kernel side:\n  " + "\n  ".join(bad)
    )


CHILD = r"""
import importlib, importlib.abc, json, sys

NOTEBOOK_PACKAGES, KERNEL_SIDE, MODULES = json.loads(sys.argv[1])


def forbidden(name):
    root = name.split(".")[0]
    return (root in NOTEBOOK_PACKAGES or root.startswith("jupyter")
            or any(name == p or name.startswith(p + ".") for p in KERNEL_SIDE))


how, importing = {}, [None]


class Recorder(importlib.abc.MetaPathFinder):
    # Sees every first import; notes who asked for a forbidden one, then lets it go on.
    def find_spec(self, name, path, target=None):
        if forbidden(name) and name not in how:
            importer, chain = None, []
            frame = sys._getframe(1)
            while frame is not None:
                mod = frame.f_globals.get("__name__", "")
                if mod != "importlib" and not mod.startswith(("importlib.", "_frozen_importlib")):
                    where = f"{mod}:{frame.f_lineno}"
                    importer = importer or where
                    if mod.startswith("labkit"):
                        chain.append(where)
                frame = frame.f_back
            how[name] = {"while_importing": importing[0], "importer": importer, "chain": chain}
        return None


sys.meta_path.insert(0, Recorder())
import os
import labkit

here = os.path.realpath(labkit.__file__)
assert here.startswith(os.path.realpath(sys.argv[2])), here  # this checkout's labkit
errors = {}
for name in MODULES:
    importing[0] = name
    try:
        importlib.import_module(name)
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
leaked = sorted(m for m in sys.modules if forbidden(m))
roots = [m for m in leaked if m.rpartition(".")[0] not in leaked]  # IPython, not IPython.core
print(json.dumps({"leaked": {m: how.get(m) for m in roots}, "errors": errors}))
"""


@pytest.mark.timeout(180)
def test_importing_every_rank_side_module_loads_no_notebook_or_kernel_package() -> None:
    modules = [
        m
        for m in _modules()
        if _under(m, RANK_SIDE) and not m.endswith(".__main__")  # __main__ runs a program
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), LABKIT_PREWARM="0")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            json.dumps([NOTEBOOK_PACKAGES, KERNEL_SIDE, modules]),
            str(PACKAGE),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    errors, leaked = report["errors"], report["leaked"]
    assert not errors, "rank-side modules that fail to import:\n  " + "\n  ".join(
        f"{name}: {error}" for name, error in errors.items()
    )
    lines = []
    for name, how in leaked.items():
        if how is None:
            lines.append(f"{name} (imported without a trace of who asked)")
            continue
        chain = " <- ".join(how["chain"]) or "no labkit frame"
        lines.append(
            f"{name}: imported by {how['importer']} while importing "
            f"{how['while_importing']} (labkit frames, innermost first: {chain})"
        )
    assert not leaked, (
        f"importing the {len(modules)} rank-side modules loaded packages a rank must not "
        "need:\n  " + "\n  ".join(lines)
    )


# -------------------------------------------------------------------- 2. module size


def test_no_module_is_over_400_lines() -> None:
    sizes = {path: len(path.read_text().splitlines()) for path in _modules().values()}
    long = sorted(((n, p) for p, n in sizes.items() if n > MAX_LINES), reverse=True)
    assert not long, (
        f"modules over {MAX_LINES} lines; split each by job, into modules named for what they "
        "do:\n  " + "\n  ".join(f"{p.relative_to(ROOT)}: {n} lines" for n, p in long)
    )


# -------------------------------------------------------------------- 3. import cycles


def _import_graph() -> dict[str, set[str]]:
    """labkit's module -> the labkit modules it imports anywhere (module level, in functions,
    under `if TYPE_CHECKING:`). An import of a module's own package, or of a package above it,
    is left out: Python has imported those before the module anyway (`import labkit` in
    labkit.kernel.launch.spawn adds nothing)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported(node, module, path, modules):
                while name and name not in modules:  # torch.nn -> torch -> "": not labkit's
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    graph[module].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) per strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}  # breadth first, inside the component, back to start
        queue = [start]
        while queue:
            v = queue.pop(0)
            if start in graph[v]:
                cycles.append([*paths[v], start])
                break
            for w in sorted(graph[v] & component):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    queue.append(w)
    return cycles


def test_no_import_cycle_among_labkit_modules() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, (
        "import cycles (an import inside a function or for type hints counts too): move the "
        "shared part into a module both import, or pass what one needs as an argument:\n  "
        + "\n  ".join(" -> ".join(c) for c in cycles)
    )


def test_cycle_finder_reports_a_chain() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# -------------------------------------------------------------------- 4. docstrings


def test_kernel_rank_and_wire_modules_have_a_docstring() -> None:
    missing = [
        str(path.relative_to(ROOT))
        for module, path in _modules().items()
        if _under(module, DOCUMENTED)
        and not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
    ]
    assert not missing, (
        "modules without a docstring (say what the module does and where it runs):\n  "
        + "\n  ".join(missing)
    )


# -------------------------------------------------------------------- 5. cited docs

CITED = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def _citations(text: str) -> set[str]:
    """Markdown files named in `text` (a path such as docs/design.md, or a bare README.md)."""
    return {m.group(1) for m in CITED.finditer(text) if "://" not in text[: m.start()][-12:]}


def test_every_cited_markdown_file_is_in_the_repo() -> None:
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py")]
    sources += [*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "docs").glob("*.md")]
    sources += [ROOT / "README.md"]
    missing = []
    for path in sources:
        for name in _citations(path.read_text()):
            if not (ROOT / name).exists() and not (path.parent / name).exists():
                missing.append(f"{path.relative_to(ROOT)} cites {name}")
    assert not missing, "cited files the repo does not have:\n  " + "\n  ".join(sorted(missing))


def test_citation_finder_sees_paths_and_bare_names() -> None:
    text = "see docs/design.md, GONE" + ".md and https://example.org/x.md"
    assert _citations(text) == {"docs/design.md", "GONE" + ".md"}


CITED_MODULE = re.compile(r"(?<![\w/.])(labkit/[\w/]+\.py)\b")


def test_every_cited_labkit_module_is_in_the_repo() -> None:
    # what a reader follows: the code's docstrings and comments, the notebooks, docs/, README
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "notebooks").glob("*.ipynb")]
    sources += [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    missing = sorted(
        f"{path.relative_to(ROOT)} cites {m.group(1)}"
        for path in sources
        for m in CITED_MODULE.finditer(path.read_text())
        if not (ROOT / m.group(1)).exists()
    )
    assert not missing, (
        "cited modules the repo does not have (a module moved? labkit/kernel/ is in folders by "
        "job, docs/layout.md):\n  " + "\n  ".join(missing)
    )


# -------------------------------------------------------------------- 6. kernel/'s parts


def _layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    return next((i for i, layer in enumerate(layers) if _under(module, layer)), None)


def _layer_violations(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Each import, among the modules `layers` covers, of a module in a higher layer."""
    bad = []
    for module in sorted(graph):
        mine = _layer_of(module, layers)
        for name in sorted(graph[module]):
            theirs = _layer_of(name, layers)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(
                    f"{module} ({', '.join(layers[mine])}) imports {name}, of a higher layer "
                    f"({', '.join(layers[theirs])})"
                )
    return bad


def test_every_kernel_module_sits_in_a_layer() -> None:
    loose = [
        m
        for m in _modules()
        if _under(m, ("labkit.kernel",))
        and m != "labkit.kernel"
        and _layer_of(m, KERNEL_LAYERS) is None
    ]
    assert not loose, (
        "kernel-side modules in no part of KERNEL_LAYERS (tests/test_layout.py); put each in "
        "the folder of its job (channel/, launch/, cell/, inspection/), or list it there and in "
        "docs/layout.md:\n  " + "\n  ".join(loose)
    )


def test_kernel_parts_import_only_their_own_layer_or_lower_ones() -> None:
    bad = _layer_violations(_import_graph(), KERNEL_LAYERS)
    layers = " < ".join("/".join(n.rpartition(".")[2] for n in layer) for layer in KERNEL_LAYERS)
    assert not bad, (
        f"labkit.kernel's parts import one way, lowest first: {layers}. Move the shared part "
        "down, or pass it as an argument:\n  " + "\n  ".join(bad)
    )


def test_layer_check_names_an_import_upwards() -> None:
    layers = (("p.low",), ("p.high",))
    graph = {"p.low.a": {"p.high.b", "q"}, "p.high.b": {"p.low.a"}, "q": {"p.high.b"}}
    assert _layer_violations(graph, layers) == [
        "p.low.a (p.low) imports p.high.b, of a higher layer (p.high)"
    ]
