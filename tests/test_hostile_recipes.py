"""Hostile and careless recipe files are refused before any work, naming the file: other encodings,
alias bombs, huge files, a list or a scalar, self-references, non-finite numbers, booleans given for
numbers, seeds out of range. And mutated recipes never get past `validate` as a traceback."""

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


def validate(path: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["validate", str(path)])
    return code, out.getvalue() + err.getvalue()


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
