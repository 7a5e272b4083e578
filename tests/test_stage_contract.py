"""The stage contract, checked on the source (ast), as tests/test_layering.py checks the imports.

A stage learns what it may know of the run from what it is given (``pipeline.stage``): its inputs'
specs and their parents' fingerprints when it resolves (``StageInputs``), and its ``StageCall`` when
it works (its own and its parents' fingerprints, its lineage, and ``upstream``: the preprocessing,
dataset and batch period the engine found in the recipe's graph). So no module below the engine
(stages, methods, the model file writer, and the parts they are made of) reads ``ctx.fingerprints``
or ``ctx.recipe``: walking the recipe or reading another stage's fingerprint from the run context
is the engine's job, done once, for every stage alike.

And the facts specs pass between stages are read typed (``Spec.cut``, ``.quantization``,
``.coded_bits``, ``.derivation``, ...), never as raw ``spec.meta`` keys, whose JSON form is an
on-disk format kept in ``pipeline/spec.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Below the engine: recipe stage types, methods, the model file writer, and the parts (layers 2 and 1 of
# tests/test_layering.py).
CHECKED = (
    "pipeline/stages", "pipeline/methods", "pipeline/deploy/model_file.py", "pipeline/deploy/networks.py",
    "pipeline/ops", "pipeline/models", "pipeline/data", "pipeline/codec",
)
FORBIDDEN = {"fingerprints", "recipe"}
# Meta keys Spec has typed views of (pipeline/spec.py), read through them only.
TYPED_META = {"cut", "derived_from", "coded_bits", "bits", "quantile_k", "feature_shape", "class_names",
              "resolution", "arch", "num_blocks", "width_mult", "small_input"}


def _files() -> list[Path]:
    out: list[Path] = []
    for name in CHECKED:
        path = ROOT / name
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def _is_context(node: ast.expr) -> bool:
    """``ctx`` or ``<anything>.ctx`` (a stage's helper holding the run context as ``self.ctx``)."""
    if isinstance(node, ast.Name):
        return node.id == "ctx"
    return isinstance(node, ast.Attribute) and node.attr == "ctx"


def context_reads(source: str) -> list[str]:
    """Each read of ``ctx.fingerprints`` / ``ctx.recipe`` (attribute, or ``getattr`` with a literal name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN and _is_context(node.value):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and _is_context(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in FORBIDDEN):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _is_meta(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "meta"


def raw_meta_reads(source: str) -> list[str]:
    """Each ``<x>.meta[KEY]`` / ``<x>.meta.get(KEY)`` of a key Spec has a typed view of."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key: ast.expr | None = None
        if isinstance(node, ast.Subscript) and _is_meta(node.value):
            key = node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and _is_meta(node.func.value) and node.args):
            key = node.args[0]
        if isinstance(key, ast.Constant) and key.value in TYPED_META:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_stage_reads_fingerprints_or_the_recipe_from_the_run_context() -> None:
    problems = [f"{path.relative_to(ROOT)} {where}" for path in _files()
                for where in context_reads(path.read_text())]
    assert not problems, (
        "stages are given what they may know (pipeline.stage: StageInputs.parents, StageCall.parents/"
        "fingerprint/upstream); found reads of the run context's fingerprints or recipe:\n  "
        + "\n  ".join(problems)
    )


def test_specs_facts_are_read_typed_not_as_raw_meta_keys() -> None:
    problems = [f"{path.relative_to(ROOT)} {where}" for path in _files()
                for where in raw_meta_reads(path.read_text())]
    assert not problems, "use Spec's typed views (pipeline/spec.py):\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(("source", "bad"), [
    ("ctx.fingerprints.get(self.model)", True),
    ("self.ctx.recipe.stages", True),
    ("getattr(ctx, 'recipe', None)", True),
    ("ctx.recipe_name", False),
    ("runner.fingerprints['cache']", False),
    ("call.parents['model']", False),
])
def test_the_context_rule_itself(source: str, bad: bool) -> None:
    assert bool(context_reads(source)) == bad


@pytest.mark.parametrize(("source", "bad"), [
    ("call.spec.meta['derived_from']", True),
    ("data.meta.get('coded_bits')", True),
    ("spec.derivation", False),
    ("node.meta.get('nn_module_stack')", False),
    ("meta['num_classes']", False),  # a weights file's own meta, not a spec's
])
def test_the_meta_rule_itself(source: str, bad: bool) -> None:
    assert bool(raw_meta_reads(source)) == bad


def test_typed_spec_facts_keep_their_stored_form() -> None:
    from pipeline.spec import STREAM, Derivation, Quantization, Spec

    stored = {"stream": "k7", "fingerprint": "ab" * 32, "train_last_blocks": 7, "blocks": [12, 15]}
    derivation = Derivation.from_meta(stored)
    assert derivation.to_meta() == stored and list(derivation.to_meta()) == list(stored)
    assert derivation.ran_blocks and not Derivation("k", None, 4, (15, 15)).ran_blocks
    lossy = {**stored, "lossy_splits": {"test": 16, "train": 4}}
    assert Derivation.from_meta(lossy).to_meta() == lossy

    spec = Spec(STREAM, 3, {}, {"class_names": ["a", "b", "c"], "resolution": 32})
    quantized = spec.with_quantization({}, Quantization(4, 0.01, (8, 2, 2)))
    coded = quantized.with_coded_bits({"train": 4, "val": 16})
    assert coded.coded_bits == {"train": 4, "val": 16} and coded.meta["coded_bits"] == {"train": 4, "val": 16}
    assert list(coded.without_coding(quantization=False).meta) == [
        "class_names", "resolution", "bits", "quantile_k", "feature_shape"]
    assert coded.without_coding().meta == spec.meta and coded.without_coding().coded_bits is None
    derived = spec.with_derivation(derivation)
    assert derived.derivation == derivation and derived.meta["derived_from"] == stored
    assert spec.derivation is None and spec.coded_bits is None
