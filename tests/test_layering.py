"""The layering of pipeline/ and stores/, checked on the source (ast): a violation fails here, not in review.

An arrow means "may import"; nothing imports a layer above its own:

    5 cli       pipeline.cli, pipeline.cache_cli, pipeline.repair (the `cache repair` command's work),
                pipeline.scaffold (the `new` command: the shipped example recipes), pipeline.__main__,
                pipeline.api (the Python API: what the commands do, as functions),
                pipeline.resolve (loading and resolving a recipe: the one pass every command makes),
                pipeline.deploy.{commands,export,predict,evaluate} (the export, predict and evaluate
                commands' work), pipeline.choose.* (the choose command: a search over runs),
                pipeline.sweep.* (the sweep command: runs of the API, planned together)
    4 config    pipeline.recipe, pipeline.registry, pipeline.derive_cuts (a recipe rewrite for sweeps)
    3 engine    pipeline.graph, pipeline.runner, pipeline.fusion, pipeline.growth, pipeline.memory_report,
                pipeline.report, pipeline.executors.* (the CLI picks the executor and hands it to the
                run context; a Dask worker re-creates its recipe through the client's Recipe class)
    2 stages    pipeline.stages.*, pipeline.methods.*   (peers that never import each other:
                a recipe stage type and a method meet only in the registry and the engine),
                pipeline.deploy.model_file and .networks (trainers write model files; rebuilding one
                uses the methods' constructors)
    1 parts     pipeline.ops.*, pipeline.models.*, pipeline.data.*, pipeline.codec.*
    0 shared    pipeline (the package: it imports nothing; the API names it exports are looked up in
                pipeline.api and the modules named there when first read), pipeline.errors, spec,
                stage, context, stream, lazy, progress, switches, storepath, heap, threads, fingerprint,
                sizes, ops.batching, recipe_model (the base of every model a recipe fills in):
                importable from every layer, and importing only each other (and
                stores). fingerprint.py is pure hashing over shared types, and stages derive the keys
                of what they store through it; ops.batching is the batch type streams (stream.py)
                are made of.
   -1 stores    stores.*: never imports pipeline.

Counted as imports: ``import``/``from`` statements anywhere in a module (inside functions
too: a deferred import is still a dependency) and ``lazy_module("pipeline....")``; not
counted: imports under ``if TYPE_CHECKING:``, which only name types for the checker.
Also checked: no import cycle between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stores")

SHARED = {
    "pipeline", "pipeline.errors", "pipeline.spec", "pipeline.stage", "pipeline.context", "pipeline.stream",
    "pipeline.lazy", "pipeline.progress", "pipeline.switches", "pipeline.storepath", "pipeline.heap",
    "pipeline.threads", "pipeline.fingerprint", "pipeline.ops.batching", "pipeline.device", "pipeline.sizes",
    "pipeline.recipe_model",
}
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (5, ("pipeline.cli", "pipeline.cache_cli", "pipeline.repair", "pipeline.__main__", "pipeline.api",
         "pipeline.resolve",
         "pipeline.scaffold", "pipeline.deploy.commands", "pipeline.deploy.export", "pipeline.deploy.predict",
         "pipeline.deploy.evaluate", "pipeline.choose", "pipeline.sweep")),
    (4, ("pipeline.recipe", "pipeline.registry", "pipeline.derive_cuts")),
    (3, ("pipeline.graph", "pipeline.runner", "pipeline.fusion", "pipeline.growth", "pipeline.memory_report",
         "pipeline.report", "pipeline.executors")),
    (2, ("pipeline.stages", "pipeline.methods", "pipeline.deploy")),
    (1, ("pipeline.ops", "pipeline.models", "pipeline.data", "pipeline.codec")),
]
# Same layer, but neither may import the other.
PEERS_APART = [("pipeline.stages", "pipeline.methods")]
# Known violations, each with the reason it is tolerated; an entry that stops being one fails the test.
PENDING: set[tuple[str, str]] = set()


def layer_of(module: str) -> int:
    if module.startswith("stores"):
        return -1
    if module in SHARED:
        return 0
    for level, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} is in no layer: add it to the table at the top of tests/test_layering.py")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def imports_of(module: str) -> set[str]:
    """Modules of pipeline/ and stores/ that ``module`` imports at run time (see the rules above)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.update(_resolve(module, path.name == "__init__.py", node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m.split(".")[0] in PACKAGES and m in MODULES and m != module}


GRAPH = {m: imports_of(m) for m in MODULES}


def _upward(module: str, target: str) -> str | None:
    here, there = layer_of(module), layer_of(target)
    if module.startswith("stores") and target.startswith("pipeline"):
        return "stores never imports pipeline"
    if here == 0 and there > 0:
        return f"a shared module imports layer {there}"
    if there > here:
        return f"layer {here} imports layer {there}"
    for a, b in PEERS_APART:
        for x, y in ((a, b), (b, a)):
            if module.startswith(x + ".") and target.startswith(y + "."):
                return f"{x} never imports {y}"
    return None


def test_no_module_imports_from_a_layer_above_it() -> None:
    found = {
        (module, target): why
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if (why := _upward(module, target)) is not None
    }
    problems = [f"{m} -> {t}: {why}" for (m, t), why in found.items() if (m, t) not in PENDING]
    assert not problems, "upward imports:\n  " + "\n  ".join(problems)
    fixed = sorted(PENDING - set(found))
    assert not fixed, f"no longer violations, remove them from PENDING: {fixed}"


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                strong(w)
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
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles() -> None:
    cycles = _cycles()
    assert not cycles, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize(("module", "target", "bad"), [
    ("pipeline.stages.forward", "pipeline.methods.finetune", True),
    ("pipeline.models.zoo", "pipeline.runner", True),
    ("pipeline.spec", "pipeline.models.zoo", True),
    ("stores.catalog", "pipeline.spec", True),
    ("pipeline.runner", "pipeline.stages.forward", False),
    ("pipeline.stages.forward", "pipeline.models.zoo", False),
    ("pipeline.methods.finetune", "pipeline.spec", False),
])
def test_the_rule_itself(module: str, target: str, bad: bool) -> None:
    assert (_upward(module, target) is not None) == bad
