"""Every candidate validated and metered before any training, and the budget errors; digits quickstart, no
training (the memory is analytic: specs only, no pretrained backbone, no cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.api import load_recipe, run_context
from pipeline.choose.meter import meter_candidates
from pipeline.choose.search import choose
from pipeline.choose.space import build_candidates, find_knobs, parse_space
from pipeline.cli import main
from pipeline.errors import BudgetError, DataError, RecipeError
from pipeline.memory_report import memory_report

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
MIB = 2**20


def candidates(*space: str) -> list[Any]:
    recipe = load_recipe(QUICKSTART)
    return build_candidates(recipe, find_knobs(recipe, "two_stage"), parse_space(list(space)), lambda a: 19)


def never_train(*args: Any, **kw: Any) -> Any:
    raise AssertionError("nothing may train when no candidate meets the budget")


def test_memory_is_the_memory_commands_and_the_budget_excludes(tmp_path: Path) -> None:
    cands = candidates("cut=7", "bits=2,4", "method=vanilla,tinytl")
    lines: list[str] = []
    metered = meter_candidates(QUICKSTART, cands, "two_stage", max_memory=5 * MIB, store=tmp_path,
                               log=lines.append)
    by_method = {m.candidate.settings["method"]: m for m in metered if m.candidate.settings["bits"] == 2}
    # what `python -m pipeline memory` prints for the same recipe
    for method, m in by_method.items():
        recipe = load_recipe(QUICKSTART, {"targets": ["two_stage"], "stages.two_stage.method": method})
        _, data = memory_report(recipe, run_context(recipe, store=tmp_path, quiet=True), measure=False)
        assert m.memory_bytes == data["stages"]["two_stage"]["total_bytes"]
    vanilla, tinytl = by_method["vanilla"], by_method["tinytl"]
    assert tinytl.memory_bytes is not None and vanilla.memory_bytes is not None
    assert tinytl.memory_bytes < 5 * MIB < vanilla.memory_bytes and tinytl.excluded is None
    assert vanilla.excluded == f"memory {vanilla.memory_bytes / MIB:.2f} MiB > budget 5.00 MiB"
    assert len(lines) == 4 and not list((tmp_path / "entries").glob("*"))  # nothing built


def test_a_method_that_cannot_apply_at_a_cut_is_excluded_with_the_reason(tmp_path: Path) -> None:
    # the last block of MobileNetV2 is a 1x1 conv: no inverted residual block for TinyTL's lite modules
    [metered] = meter_candidates(QUICKSTART, candidates("cut=1", "bits=2", "method=tinytl:lite"), "two_stage",
                                 max_memory=64 * MIB, store=tmp_path, log=lambda line: None)
    assert metered.memory_bytes is None
    assert metered.excluded is not None and metered.excluded.startswith("invalid: ")
    assert "hold no inverted residual block" in metered.excluded


def test_a_wrong_value_type_names_the_candidate(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as err:
        meter_candidates(QUICKSTART, candidates("cut=7", "bits=2,3", "method=vanilla"), "two_stage",
                         max_memory=64 * MIB, store=tmp_path, log=lambda line: None)
    assert "candidate c02 (cut=7 bits=3 method=vanilla)" in str(err.value)
    assert "stages.quantized.bits" in str(err.value)


def test_no_candidate_within_memory_says_which_and_trains_nothing(tmp_path: Path) -> None:
    with pytest.raises(BudgetError) as err:
        choose(QUICKSTART, max_memory=100 * 1024, max_epoch_seconds=10, target="two_stage",
               space=parse_space(["cut=1,7", "bits=2", "method=vanilla,tinytl:lite"]),
               store=tmp_path, output=tmp_path / "out", log=lambda line: None, train=never_train)
    message = str(err.value)
    assert message.startswith("no candidate meets the budget: --max-memory 0.10 MiB excluded 3: the "
                              "smallest, c04 (cut=7 bits=2 method=tinytl:lite), needs ")
    assert "1 cannot run as set up (invalid: " in message and "hold no inverted residual block" in message


def test_cli_bad_input_exits_2_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["choose", str(QUICKSTART), "--store", str(tmp_path), "--output", str(tmp_path / "out")]
    ok = ["--max-memory", "64MiB", "--max-epoch-seconds", "5"]
    for bad, expected in [
        (["--max-memory", "12 parsecs", "--max-epoch-seconds", "5"], "expected a size like 2GiB"),
        (["--max-memory", "0", "--max-epoch-seconds", "5"], "expected a positive size"),
        (["--max-memory", "1.5GB", "--max-epoch-seconds", "0"], "expected a positive number of seconds"),
        (["--max-memory", "64MiB", "--max-epoch-seconds", "-1"], "expected a positive number of seconds"),
        ([*ok, "--eta", "1"], "expected an integer >= 2"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main([*base, *bad])
        assert exit_.value.code == 2
        assert expected in capsys.readouterr().err
    for extra, expected in [
        (["--space", "bits="], "no values"),
        (["--target", "two_stage", "--space", "bitz=2"], "did you mean 'bits'"),
        ([], "name the one to tune with --target STAGE"),
        (["--target", "two_stage", "--space", "bits=2", "--space", "cut=7", "--space", "method=vanilla",
          "--max-memory", "100KiB"], "no candidate meets the budget: --max-memory 0.10 MiB excluded 1"),
    ]:
        assert main([*base, *ok, *extra]) == 2
        assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_candidate_that_cannot_resolve_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Duplicate classes pass the schema; the split finds them while the candidate resolves (as validate
    # and plan do): no candidate could run like that, so it is bad input, not a candidate left out.
    space = ("cut=7", "bits=2", "method=vanilla", "stages.target_digits.classes=[5,6],[5,5]")
    with pytest.raises(DataError) as err:
        meter_candidates(QUICKSTART, candidates(*space), "two_stage", max_memory=64 * MIB, store=tmp_path,
                         log=lambda line: None)
    message = str(err.value)
    assert message.startswith("candidate c02 (") and "stages.target_digits.classes=[5, 5]" in message
    assert f"{QUICKSTART}: stages.target_digits (split): classes lists [5] more than once" in message
    argv = ["choose", str(QUICKSTART), "--store", str(tmp_path), "--output", str(tmp_path / "out"),
            "--max-memory", "64MiB", "--max-epoch-seconds", "5", "--target", "two_stage",
            *sum((["--space", s] for s in space), [])]
    assert main(argv) == 2
    assert "error: candidate c02 (" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list((tmp_path / "entries").glob("*"))
