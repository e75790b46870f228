"""The package's import graph: no cycles, and data flowing one way between the layers.

Every module of ampdoctor/ is parsed with `ast` (nothing is imported). An edge A -> B is any
`import` / `from ... import` of B in A, relative or absolute, at module level or inside a
function (an import deferred to a function is still a dependency). Imports under
`if TYPE_CHECKING:` are annotations only and do not count for the layers, but do for the
cycle check (a type a module needs from one that imports it is a Protocol of its own).
`from package import name` is an edge to `package.name` when that is a module, else to the
package itself; the root package (`ampdoctor/__init__.py`, whose public names are imported
lazily in `__getattr__`) is imported by no module of the package (the version is in
`_version`) and counts as foundation.

The layers, lowest first; a module may import from its own layer or a lower one, never from a
higher one (cycles within a layer are caught by the cycle check):

  foundation  pure Python, no torch: core/ (errors, safetext, limits, thresholds, the string
              enums, the typed evidence, the findings types, progress, memory, source_snippet,
              process_state, processes: a run's process tree, ended), kinds/ (the kinds'
              units: the catalogue, each kind's decider and observations), and the root
              package (its `__version__`, in `_version`)
  static      what runs without torch or the user's loop: spec/ (the spec, and a script's run
              source), record/, init/ (`ampdoctor init`), scan/ (the static scan), report/
              (never any layer above: they must work without torch)
  maths       maths/: tensor maths without a run: compare, shards, rng
  observe     probe/: the patched torch functions, the typed events, the Trace of one run
  user code   loading/: the user's code, model, optimizers and data; examples/: the loops
              `ampdoctor demo` ships (user code, never imported by ampdoctor)
  reference   reference/: the fp32 teacher-forced gradients and the clipping the loop meant
  session     session/: the runs of one diagnose (the loop under the probe, its references)
  judge       judge/: consumed gradient against the reference -> numbers and verdicts
  explain     rules/: why a step is off (kind, numbers, file:line)
  ladder      ladder/ (one module per rung, the driver of the extra passes a rule asks for)
              and ddp/ (the ddp-sync rung's processes, each a small rung driver)
  drivers     runner/ (one diagnose end to end; export_test: a diagnosis re-run as a test, the
              CLI in a process of its own) and api (the Python API, at the root); script/: one
              diagnose of a script (script mode: its runs in child processes, its rungs, its
              record); sentinel/: `ampdoctor.watch`, the checks inside a real training run
  entry       cli/ (one module per command), supervise/ (the CLI's watchdog, its records, and
              worker: the child process it runs), pytest_plugin, __main__
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "ampdoctor"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: Layer name -> the modules in it (a name ending in ".*" covers a package and its modules).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("ampdoctor", "ampdoctor._version", "ampdoctor.core", "ampdoctor.core.*",
                    "ampdoctor.kinds", "ampdoctor.kinds.*", "ampdoctor.kind_text")),
    ("static", ("ampdoctor.spec", "ampdoctor.spec.*", "ampdoctor.record", "ampdoctor.record.*",
                "ampdoctor.init", "ampdoctor.init.*", "ampdoctor.scan.*", "ampdoctor.report.*")),
    ("maths", ("ampdoctor.maths", "ampdoctor.maths.*")),
    ("observe", ("ampdoctor.probe.*",)),
    ("user code", ("ampdoctor.loading.*", "ampdoctor.examples.*")),
    ("reference", ("ampdoctor.reference.*",)),
    ("session", ("ampdoctor.session", "ampdoctor.session.*")),
    ("judge", ("ampdoctor.judge", "ampdoctor.judge.*")),
    ("explain", ("ampdoctor.rules.*",)),
    ("ladder", ("ampdoctor.ladder.*", "ampdoctor.ddp.*")),
    ("drivers", ("ampdoctor.runner", "ampdoctor.runner.*", "ampdoctor.api", "ampdoctor.script.*",
                 "ampdoctor.sentinel", "ampdoctor.sentinel.*")),
    ("entry", ("ampdoctor.cli.*", "ampdoctor.supervise", "ampdoctor.supervise.*",
               "ampdoctor.pytest_plugin", "ampdoctor.__main__")),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, types: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, but those under `if TYPE_CHECKING:`
    (unless `types`)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not types:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: set[str]) -> set[str]:
    """The ampdoctor modules one import statement depends on."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source != PACKAGE and not source.startswith(PACKAGE + "."):
        return set()
    out = set()
    for alias in node.names:
        child = f"{source}.{alias.name}"
        if child in known:
            out.add(child)
        elif source in known:
            out.add(source)
    return out


def import_graph(types: bool = False) -> dict[str, set[str]]:
    """Module -> the ampdoctor modules it imports (at run time; with `types`, for the type
    checker too)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in _imports(tree, types):
            edges |= _targets(name, path.name == "__init__.py", node, known)
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        # iterative Tarjan: (node, iterator over its successors)
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, successors = work[-1]
            advanced = False
            for w in successors:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return components


def _path_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A cycle through the component's first module, found breadth first inside it."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for w in sorted(graph[node] & members):
                if w == start:   # node -> start closes the cycle: walk back to start
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in parents:
                    parents[w] = node
                    following.append(w)
        frontier = following
    return component


def layer_of(module: str) -> int:
    for rank, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern.endswith(".*"):
                package = pattern[:-2]
                if module == package or module.startswith(package + "."):
                    return rank
            elif module == pattern:
                return rank
    raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: add it to "
                         "LAYERS where it belongs")


def test_the_graph_sees_relative_absolute_and_function_level_imports():
    graph = import_graph()
    assert "ampdoctor.probe.recorder" in graph["ampdoctor.ladder.deadline"]     # from ..probe
    assert "ampdoctor.scan.sites" in graph["ampdoctor.scan.graph"]             # absolute
    assert "ampdoctor.ladder" in graph["ampdoctor.runner"]                     # in a function
    assert "ampdoctor._version" in graph["ampdoctor.runner"]  # from ._version import __version__
    assert "ampdoctor.api" not in graph["ampdoctor"]      # TYPE_CHECKING and lazy __getattr__


@pytest.mark.parametrize("types", [False, True], ids=["run time", "with type-only imports"])
def test_no_import_cycles(types):
    """None at run time (module level or in a function), nor for the type checker: a type a
    module needs from one that imports it is a Protocol of its own."""
    graph = import_graph(types)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(
        " -> ".join(_path_in(graph, c)) + f"   (modules in the cycle: {', '.join(c)})"
        for c in cycles)


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_imports_only_go_down_the_layers():
    graph = import_graph()
    against = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                against.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                               f"({LAYERS[layer_of(target)][0]})")
    assert not against, "imports against the flow of data:\n" + "\n".join(against)


#: The most lines one module may have: past it a module does more than one job, split it.
MAX_LINES = 450
#: Modules allowed over the bound until their split lands (none now); the test fails once an
#: entry here is back under the bound, so the list cannot go stale.
OVER_MAX_UNTIL_SPLIT: set[str] = set()


def test_no_module_is_over_the_line_bound():
    sizes = {str(path.relative_to(ROOT.parent)): len(path.read_text(encoding="utf-8").splitlines())
             for path in sorted(ROOT.rglob("*.py"))}
    over = [f"{name}: {lines} lines" for name, lines in sizes.items()
            if lines > MAX_LINES and name not in OVER_MAX_UNTIL_SPLIT]
    assert not over, f"modules over {MAX_LINES} lines (split each along a seam):\n" + \
        "\n".join(over)
    stale = [name for name in OVER_MAX_UNTIL_SPLIT if sizes.get(name, 0) <= MAX_LINES]
    assert not stale, f"{stale} no longer over {MAX_LINES} lines: remove from OVER_MAX_UNTIL_SPLIT"
