"""The README and docs/ say what the code does: links resolve, the commands they show exist, the install
commands match CI's and name real extras, and the example recipe is valid."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeline.cli import _parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "discussion.md"]
# Commands the README documents that other branches of issue 23 add (export, predict, evaluate). Once one of
# them is a real command this test fails: remove it from the set.
def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a file's headings."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        text = heading.strip().lower().replace(" ", "-")
        found.add("".join(c for c in text if c.isalnum() or c in "-_"))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_and_anchors_resolve(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: link {link} points to nothing"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path.read_text(encoding="utf-8")), f"{doc.name}: no heading for {link}"


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_the_two_commands_install_everything_and_ci_runs_the_same() -> None:
    run_cmd, test_cmd = bash_blocks(README.read_text())[:2]
    assert "pip install -e '.[all]'" in run_cmd and run_cmd.strip().endswith("run recipes/quickstart.yaml")
    assert "pip install -e '.[all,dev]'" in test_cmd and test_cmd.strip().endswith("pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/pip install -q -e '.[all,dev]'" in ci
    assert ".venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1" in ci
    assert "pip install torch==2.14.1 torchvision==0.29.1" in run_cmd


def test_every_extra_the_docs_name_exists() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set()
    for doc in DOCS:
        for group in re.findall(r"\.\[([a-z,]+)\]", doc.read_text(encoding="utf-8")):
            named |= set(group.split(","))
    assert named and named <= extras, named - extras


def test_every_command_shown_is_a_command() -> None:
    commands = set(_parser()._subparsers._group_actions[0].choices)  # the subcommand names
    shown = set()
    for doc in DOCS:
        shown |= set(re.findall(r"python -m pipeline ([a-z]+)", doc.read_text(encoding="utf-8")))
    assert {"run", "plan", "validate", "memory", "cache", "new", "stages", "export", "predict",
            "evaluate"} <= shown
    assert shown <= commands, shown - commands


def test_every_recipe_path_shown_exists() -> None:
    for doc in DOCS:
        for path in re.findall(r"recipes/[\w/]+\.yaml", doc.read_text(encoding="utf-8")):
            assert (ROOT / path).is_file(), f"{doc.name}: {path}"


def test_the_own_data_recipe_is_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S) if "image_folder" in b]
    recipe = yaml.safe_load(block)
    assert recipe["stages"]["photos"]["type"] == "image_folder"
    weights = recipe["stages"]["backbone"]["weights"]
    assert weights.endswith(".pth")
    path = tmp_path / "flowers.yaml"
    path.write_text(block)
    # validate resolves the stages as plan does, so it reads the data the recipe names (relative to here)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(path)]) == 2
    assert "stages.photos (image_folder): image_folder root photos does not exist" in capsys.readouterr().err
    from PIL import Image

    for flower in ("daisy", "rose"):
        (tmp_path / "photos" / flower).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "photos" / flower / f"{i}.png")
    (tmp_path / weights).write_bytes(b"a state_dict")  # a weights file is only hashed until a run loads it
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
