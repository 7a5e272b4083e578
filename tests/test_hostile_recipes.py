"""Hostile and careless recipe files are refused before any work, naming the file: other encodings,
alias bombs, huge files, a list or a scalar, self-references, non-finite numbers, booleans given for
numbers, seeds out of range. Mutated recipes never get past `validate` as a traceback, and what `plan`
refuses (found while the stages resolve: classes, cuts, data), `validate` refuses too."""

from __future__ import annotations

import io
import re
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli import main
from pipeline.errors import RecipeError
from pipeline.recipe import MAX_RECIPE_BYTES, load_recipe

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = (ROOT / "recipes" / "quickstart.yaml").read_text()


def cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


def validate(path: Path, *overrides: str) -> tuple[int, str]:
    return cli("validate", str(path), *sum((["--set", o] for o in overrides), []))


def alias_bomb(levels: int = 12) -> str:
    text = 'a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n'
    for i in range(1, levels):
        text += f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n"
    return text + "name: bomb\nstages: {}\n"


def quickstart_with(old: str, new: str) -> bytes:
    return QUICKSTART.replace(old, new).encode()


HOSTILE: dict[str, tuple[bytes, str]] = {
    "latin1": (QUICKSTART.replace("name: quickstart", "name: caf\xe9").encode("latin-1"),
               r"hostile.yaml:\d+: the recipe is not UTF-8 text \(byte 0xe9"),
    "utf16": (QUICKSTART.encode("utf-16"), "hostile.yaml: the recipe is UTF-16 text; save it as UTF-8"),
    "bomb": (alias_bomb().encode(), r"hostile.yaml:\d+: this expands to more than 100000 values .*bomb"),
    "big": ((QUICKSTART + "#" + "x" * MAX_RECIPE_BYTES).encode(),
            "the recipe file has .* bytes; a recipe is at most"),
    "list": (b"- a\n- b\n", "expected a mapping at the top, found list"),
    "scalar": (b"42\n", "expected a mapping at the top, found int"),
    "self": (b"x: &x [*x]\nname: s\nstages: {}\n", "a self-referencing anchor"),
    "deep": (("name: d\nstages: {}\nx: " + "[" * 200 + "]" * 200 + "\n").encode(),
             "nested more than 64 levels"),
    "nul": (b"name: a\x00b\nstages: {}\n", r"character #x0000 at offset 7"),
    "nan": (quickstart_with("lr: 0.01, optimizer", "lr: .nan, optimizer"),
            "train.lr: Input should be a finite number; found nan"),
    "inf": (quickstart_with("lr: 0.01, optimizer", "lr: .inf, optimizer"),
            "train.lr: Input should be a finite number; found inf"),
    "seed": (quickstart_with("seed: 0", "seed: -1"), "seed: expected a seed from 0 to 4294967295"),
    "bigseed": (quickstart_with("seed: 0", "seed: 123456789012345678901"), "expected a seed from 0"),
    "bits": (quickstart_with("bits: 2", "bits: true"),
             "stages.quantized.bits: expected a number, not a YAML boolean"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_recipe_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    data, expected = HOSTILE[name]
    path = tmp_path / "hostile.yaml"
    path.write_bytes(data)
    code, text = validate(path)
    assert code == 2, text
    assert "hostile.yaml" in text and "Traceback" not in text and "internal error" not in text, text
    assert re.search(expected, text), text
    with pytest.raises(RecipeError):
        load_recipe(path)


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(levels=12))  # 9**12 strings once expanded
    tracemalloc.start()
    try:
        with pytest.raises(RecipeError, match="alias bomb"):
            load_recipe(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20  # bytes Python allocated for it: the text, the node tree, no expansion


def test_anchors_a_real_recipe_uses_still_load(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text(QUICKSTART.replace("train: {epochs: 12, lr: 0.01, optimizer: adamw, schedule: cosine}",
                                       "train: &t {epochs: 12, lr: 0.01, optimizer: adamw, schedule: cosine}")
                    .replace("  quantized:", "  unused_anchor_user: {type: digits}\n  quantized:"))
    assert load_recipe(path).name == "quickstart"


# ---------------------------------------------------------------------------- mutated recipes
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(-3, 12), max_size=4),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            out += _paths(child, (*prefix, i))
    return out


BASE = yaml.safe_load(QUICKSTART)
PATHS = _paths(BASE)


@st.composite
def mutated(draw: st.DrawFn) -> Any:
    import copy

    data: Any = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent = data
        try:
            for key in path[:-1]:
                parent = parent[key]
            action = draw(st.sampled_from(["replace", "delete", "rename"]))
            if action == "replace":
                parent[path[-1]] = draw(SCALARS)
            elif action == "delete" and isinstance(parent, dict):
                del parent[path[-1]]
            elif action == "rename" and isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=8))] = parent.pop(path[-1])
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this path
    if draw(st.booleans()):
        data = draw(st.sampled_from([data, [data], 3, "text", None]))
    return data


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated())
def test_validate_answers_a_mutated_recipe_with_an_exit_code_never_a_traceback(
    tmp_path: Path, data: Any
) -> None:
    path = tmp_path / "mutated.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    tracemalloc.start()
    try:
        code, text = validate(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code in (0, 2), text
    assert "Traceback" not in text and "internal error" not in text, text
    if code == 2:
        assert "mutated.yaml" in text.splitlines()[0] or "mutated.yaml" in text, text
    assert peak < 200 * 2**20


# ----------------------------------------------------------------- refused while stages resolve
QUICKSTART_FILE = ROOT / "recipes" / "quickstart.yaml"
FASHION_FILE = ROOT / "recipes" / "cache_reuse" / "fashion_mnist.yaml"
# (recipe, --set, what the one-line message says after the file): each found only by resolving the
# stages (labels, specs, data on disk) or by checking the graph; plan finds each the same way.
RESOLVE_ERRORS = {
    "duplicate classes": (QUICKSTART_FILE, "stages.target_digits.classes=[5,5,6]",
                          r"stages\.target_digits \(split\): classes lists \[5\] more than once"),
    "classes out of range": (QUICKSTART_FILE, "stages.target_digits.classes=[5,42]",
                             r"stages\.target_digits \(split\): classes \[42\] out of range: this dataset "
                             r"has 10 classes"),
    "cut deeper than the network": (QUICKSTART_FILE, "stages.features.train_last_blocks=25",
                                    r"stages\.features\.train_last_blocks: train_last_blocks=25 is outside "
                                    r"the valid range 0\.\.19"),
    "trainer without its input": (QUICKSTART_FILE, "stages.two_stage.features=null",
                                  r"stages\.two_stage \(finetune\): mode 'two_stage' reads from `features:`, "
                                  r"which is not set"),
    "input of the wrong kind": (QUICKSTART_FILE, "stages.two_stage.features=target_digits",
                                r"stages\.two_stage\.features: expected a stage producing a stream, but "
                                r"'target_digits' \(split\) produces a dataset"),
    "dequantize of unquantized features": (QUICKSTART_FILE, "stages.dequantized.input=features",
                                           r"stages\.dequantized \(dequantize\): expected a quantized "
                                           r"feature stream"),
    "dataset not on this machine": (FASHION_FILE, "stages.fmnist.root={tmp}",
                                    r"stages\.fmnist \(fashion_mnist\): fashion_mnist: the idx files .* "
                                    r"were not found in {tmp}"),
}


@pytest.mark.parametrize("case", sorted(RESOLVE_ERRORS))
def test_validate_refuses_what_only_resolving_finds_as_plan_does(tmp_path: Path, case: str) -> None:
    recipe, override, expected = RESOLVE_ERRORS[case]
    override, expected = override.format(tmp=tmp_path), expected.format(tmp=re.escape(str(tmp_path)))
    code, text = validate(recipe, override)
    assert code == 2, text
    assert "Traceback" not in text and "internal error" not in text, text
    assert re.search(f"{re.escape(str(recipe))}.*{expected}", text), text
    planned, plan_text = cli("plan", str(recipe), "--set", override, "--store", str(tmp_path / "store"))
    assert planned == 2 and re.search(expected, plan_text), plan_text


def test_validate_needs_no_store_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    scratch, home = tmp_path / "tmp", tmp_path / "home"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the scratch store is made
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))  # the per-user default store
    monkeypatch.delenv("ONDEVICE_TL_STORE", raising=False)
    # a store that plan could not use (its parent does not exist): validate does not look at it
    store = tmp_path / "no" / "such" / "store"
    code, text = validate(QUICKSTART_FILE, f"store.path={store}")
    assert code == 0 and "valid (12 stages, 12 resolved; targets: baseline, two_stage)" in text, text
    assert not store.parent.exists() and not home.exists()
    assert list(scratch.iterdir()) == []  # the scratch store is removed
    code, text = validate(QUICKSTART_FILE, "stages.target_digits.classes=[5,5]")
    assert code == 2 and list(scratch.iterdir()) == [], text


@st.composite
def retyped(draw: st.DrawFn) -> Any:
    """The quickstart with one or two values replaced by others of the same type (a class list by
    another, a stage name by another): most still load, so the stages' resolve pass is what judges."""
    import copy

    data: Any = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 2))):
        *parents, key = draw(st.sampled_from(PATHS))
        parent = data
        try:
            for part in parents:
                parent = parent[part]
            old = parent[key]
        except (IndexError, TypeError):
            continue  # an earlier mutation made this list shorter, or replaced it
        if isinstance(old, bool) or not isinstance(old, int | float | str | list):
            continue
        if isinstance(old, int):
            parent[key] = draw(st.integers(-1, 30))
        elif isinstance(old, float):
            parent[key] = draw(st.floats(0.0, 1.0))
        elif isinstance(old, list):
            parent[key] = draw(st.lists(st.integers(-1, 11), max_size=5))
        else:
            parent[key] = draw(st.sampled_from([old, *BASE["stages"]]))
    return data


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=retyped())
def test_validate_and_plan_give_a_mutated_recipe_the_same_verdict(tmp_path: Path, data: Any) -> None:
    path = tmp_path / "mutated.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    validated, text = validate(path)
    planned, plan_text = cli("plan", str(path), "--store", str(tmp_path))
    assert (validated, planned) in ((0, 0), (2, 2)), f"validate: {text}\nplan: {plan_text}"
    if validated == 2:
        assert "mutated.yaml" in text and "Traceback" not in text, text
