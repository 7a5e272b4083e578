"""The results page: one section per result JSON (known or not), malformed files skipped by name,
byte-identical reruns, and real PNG plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.image
import pytest

from benchmarks import results_page
from benchmarks.pages.common import nbytes, pct, sig
from benchmarks.results_page import main, renderers

REPO_RESULTS = Path(results_page.__file__).resolve().parent / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# A result of a type the page has never seen (as neuroflux/dask ones will be), written the way
# benchmarks/_meta.write_result writes every result.
UNKNOWN = {
    "name": "neuroflux_spill_test",
    "created": "2026-11-24T10:00:00+00:00",
    "git_commit": "abc1234",
    "machine": {
        "cpu": "Test CPU",
        "cpu_count": 4,
        "memory_bytes": 8 * 2**30,
        "python": "3.11.7",
        "versions": {"torch": "2.14.1", "dask": None},
    },
    "command": "python -m benchmarks.bench_neuroflux --spill",
    "question": "how much does spilling cost?",
    "settings": {"workers": 2, "chunk_bytes": 1048576},
    "spill_bytes": 3 * 2**20,
    "throughput": {"local": 1234.5678, "dask": 987.6},
    "rows": [
        {"workers": 1, "images_per_s": 101.234, "peak_bytes": 52428800},
        {"workers": 2, "images_per_s": 180.5, "peak_bytes": 104857600, "note": "second worker"},
    ],
    "runs": {  # a dict of records, as dask_build.json has
        "local": {"build_s": 10.25, "extra": {"workers": 1}},
        "dask_2x1": {"build_s": 6.0, "extra": {"workers": 2}},
    },
    "targets": {"overhead_within_10pct": True, "scales": False},
}


def run(results: Path, output: Path, *extra: str) -> int:
    return main(["--results", str(results), "--output", str(output), *extra])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Every committed result JSON, plus an unknown-structure one and a malformed one, rendered once."""
    results = tmp_path_factory.mktemp("results")
    for path in sorted(REPO_RESULTS.glob("*.json")):
        shutil.copy(path, results / path.name)
    (results / "neuroflux_spill_test.json").write_text(json.dumps(UNKNOWN))
    (results / "broken.json").write_text('{"name": "broken", "rows": [1, 2,')
    output = results.parent / "README.md"
    assert run(results, output) == 0
    return results, output


def test_every_result_gets_a_section_including_unknown_ones(built: tuple[Path, Path]) -> None:
    results, output = built
    text = output.read_text()
    good = sorted(p.stem for p in results.glob("*.json") if p.stem != "broken")
    assert len(good) >= 2
    for stem in good:
        assert f"\n## {stem}\n" in text, stem
        assert f"[{stem}](#{stem})" in text  # headline line linking to the section
    assert f"Generated from {len(good)} results" in text

    section = text.split("\n## neuroflux_spill_test\n", 1)[1].split("\n## ", 1)[0]
    assert "how much does spilling cost?" in section
    assert "| throughput.local | 1235 |" in section  # nested dict of scalars, no 1.23e+03
    assert "| spill_bytes | 3 MiB |" in section  # a *_bytes field shown as bytes
    assert "| workers | images_per_s | peak_bytes | note |" in section  # union of the rows' keys
    assert "| 2 | 180 | 100 MiB | second worker |" in section
    assert "| 1 | 101 | 50 MiB | – |" in section
    assert "|  | build_s | extra.workers |" in section  # dict of records: one row per key
    assert "| dask_2x1 | 6 | 2 |" in section
    assert "**Targets:** **not met** (1/2 met)" in section
    assert "Test CPU, 4 cores, 8 GiB memory" in section
    assert "torch 2.14.1" in section and "dask" not in section.split("- Versions:")[1].split("\n")[0]
    assert "`python -m benchmarks.bench_neuroflux --spill`" in section
    assert "python -m benchmarks.bench_neuroflux --spill" in text.split("## Regenerate")[1].split("\n## ")[0]


def test_malformed_json_is_named_and_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "neuroflux_spill_test.json").write_text(json.dumps(UNKNOWN))
    (results / "broken.json").write_text('{"name": "broken", "rows": [1, 2,')
    (results / "a_list.json").write_text("[1, 2, 3]")
    output = tmp_path / "README.md"

    assert run(results, output) == 0
    err = capsys.readouterr().err
    assert "broken.json" in err and "not valid JSON (line 1" in err
    assert "a_list.json" in err and "expected an object" in err
    text = output.read_text()
    assert "## Skipped files" in text and "`broken.json`" in text and "`a_list.json`" in text
    assert "\n## broken\n" not in text and "\n## neuroflux_spill_test\n" in text
    assert "Generated from 1 result " in text

    assert run(results, output, "--strict") == 1
    (results / "broken.json").unlink()
    (results / "a_list.json").unlink()
    assert run(results, output, "--strict") == 0


def test_known_type_with_a_new_layout_falls_back_to_generic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    changed = {"name": "prefetch_sdcard", "rows": [{"setting": "new_layout", "epoch_s": 1.5}]}
    (results / "prefetch_sdcard.json").write_text(json.dumps(changed))
    output = tmp_path / "README.md"
    assert run(results, output) == 0
    assert "prefetch_sdcard.json" in capsys.readouterr().err
    text = output.read_text()
    assert "\n## prefetch_sdcard\n" in text
    assert "| new_layout | 1.5 |" in text
    assert "- Command: not recorded" in text and "- Machine: not recorded" in text


def test_rerun_is_byte_identical(built: tuple[Path, Path]) -> None:
    results, output = built
    plots = results / "plots"
    before = {p: p.read_bytes() for p in [output, *sorted(plots.glob("*.png"))]}
    mtimes = {p: p.stat().st_mtime_ns for p in before}
    assert run(results, output) == 0
    after = {p: p.read_bytes() for p in [output, *sorted(plots.glob("*.png"))]}
    assert after == before
    # Unchanged files are not even rewritten, so a rerun leaves git status and mtimes alone.
    assert {p: p.stat().st_mtime_ns for p in after} == mtimes


def test_plots_are_valid_pngs_linked_from_the_page(built: tuple[Path, Path]) -> None:
    results, output = built
    text = output.read_text()
    pngs = sorted((results / "plots").glob("*.png"))
    assert pngs
    # The speedup and I/O plots, whenever their results are among the committed ones.
    for stem, plot in (("cache_reuse_epoch_time", "epoch_seconds"), ("prefetch_sdcard", "epoch_seconds")):
        if (REPO_RESULTS / f"{stem}.json").exists():
            assert results / "plots" / f"{stem}_{plot}.png" in pngs
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        pixels = matplotlib.image.imread(png)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert f"({results.name}/plots/{png.name})" in text


def test_stale_plots_are_removed(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "plots").mkdir(parents=True)
    stale = results / "plots" / "gone_result_plot.png"
    stale.write_bytes(PNG_SIGNATURE)
    (results / "neuroflux_spill_test.json").write_text(json.dumps(UNKNOWN))
    assert run(results, tmp_path / "README.md") == 0
    assert not stale.exists()


def test_missing_results_directory_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(tmp_path / "nope", tmp_path / "README.md") == 2
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_the_hand_written_discussion_sits_after_the_headline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "neuroflux_spill_test.json").write_text(json.dumps(UNKNOWN))
    notes = tmp_path / "notes.md"
    notes.write_text("## By method\n\n| bits | accuracy |\n|---:|---:|\n| 2 | 91.4 |\n")
    assert run(results, tmp_path / "README.md", "--discussion", str(notes)) == 0
    text = (tmp_path / "README.md").read_text()
    assert text.index("## Headline") < text.index("## By method\n\n| bits | accuracy |") < text.index(
        "## Regenerate"
    )
    assert run(results, tmp_path / "bare.md", "--discussion", "") == 0
    assert "## By method" not in (tmp_path / "bare.md").read_text()
    assert run(results, tmp_path / "x.md", "--discussion", str(tmp_path / "gone.md")) == 2
    assert "gone.md does not exist" in capsys.readouterr().err


def test_the_committed_page_is_up_to_date_with_its_discussion() -> None:
    # benchmarks/discussion.md is edited by hand; the page carries it only after regenerating.
    discussion = results_page.DEFAULT_DISCUSSION.read_text(encoding="utf-8").strip()
    assert discussion in results_page.DEFAULT_OUTPUT.read_text(encoding="utf-8"), (
        "run `python -m benchmarks.results_page` after editing benchmarks/discussion.md"
    )


def test_number_formatting() -> None:
    assert sig(1589.558) == "1590"
    assert sig(27.5378) == "27.5"
    assert sig(0.27040816) == "0.270"
    assert sig(0.01) == "0.01"  # exact values lose padding zeros
    assert sig(50.0) == "50"
    assert sig(9.9996) == "10.0"
    assert nbytes(205067) == "200 KiB"
    assert nbytes(19928276) == "19.0 MiB"
    assert nbytes(512) == "512 B"
    assert pct(0.4549763) == "45.5%"


def test_each_benchmark_renders_its_own_section_found_by_discovery() -> None:
    found = renderers()
    # One module per benchmark in benchmarks.pages, each naming the results it renders.
    for name in ("cache_reuse_epoch_time", "cache_reuse_epoch_time_malloc_defaults", "codec", "neuroflux",
                 "prefetch_sdcard", "prefetch_sdcard_hdf5", "mixed_precision_cut", "openmp_spin"):
        assert name in found, name
    assert found["prefetch_sdcard"] is found["prefetch_sdcard_hdf5"]
    assert found["codec"].__module__ == "benchmarks.pages.codec"
    assert "neuroflux_spill_test" not in found  # unknown results get the generic section


def test_a_record_whose_script_was_removed_is_not_offered_as_a_rerun(built: tuple[Path, Path]) -> None:
    _, output = built
    text = output.read_text()
    if not (REPO_RESULTS / "openmp_spin.json").exists():
        pytest.skip("no openmp_spin result committed")
    regenerate = text.split("## Regenerate")[1].split("\n## ")[0]
    assert "bench_openmp_spin" not in regenerate
    assert "# (a record only: its script was removed)" in regenerate
    section = text.split("\n## openmp_spin\n", 1)[1].split("\n## ", 1)[0]
    assert "Switch removed because of this result" in section
    assert "`python -m benchmarks.bench_openmp_spin --batches 8 --repeats 6`" in section  # provenance stays


def test_gpu_results_sit_beside_their_cpu_result_each_naming_its_machine(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(REPO_RESULTS / "codec.json", results / "codec.json")
    shutil.copy(REPO_RESULTS / "neuroflux.json", results / "neuroflux.json")
    gpu = {"name": "codec_cuda", "created": "2026-11-26T00:00:00+00:00", "machine": {"cpu": "host CPU"},
           "headline": "quantize+pack ≤ 1.00 µs per map",
           "device": {"device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3", "cuda": "12.8"}}
    (results / "codec_cuda.json").write_text(json.dumps(gpu))
    output = tmp_path / "README.md"
    assert run(results, output) == 0
    text = output.read_text()
    headline = text.split("## Headline", 1)[1].split("\n## ", 1)[0]
    codec_row = next(line for line in headline.splitlines() if line.startswith("| codec |"))
    cpu_cell, gpu_cell = codec_row.split(" | ")[1:3]
    assert "[codec](#codec)" in cpu_cell and "2 cores" in cpu_cell
    assert "[codec_cuda](#codec_cuda)" in gpu_cell and "NVIDIA H100 80GB HBM3" in gpu_cell
    # one row, two columns
    assert not any(line.startswith("| codec_cuda |") for line in headline.splitlines())
    # A benchmark whose GPU run is still missing says so, with the command that measures it.
    neuroflux_row = next(line for line in headline.splitlines() if line.startswith("| neuroflux |"))
    assert "not measured yet: `python -m benchmarks.bench_neuroflux --device cuda" in neuroflux_row
    section = text.split("\n## codec_cuda\n", 1)[1].split("\n## ", 1)[0]
    assert "- Machine: GPU NVIDIA H100 80GB HBM3 (CUDA 12.8), host: host CPU" in section


def test_memory_blocks_show_the_map_convention_only_where_the_result_has_it(tmp_path: Path) -> None:
    record = json.loads((REPO_RESULTS / "memory.json").read_text())
    for b in record["blocks"]:  # as bench_memory writes them since the meter's map convention
        b.update(activation_bytes_map=2 * b["activation_bytes"], measured_over_map=0.5,
                 reduction_vs_vanilla_map=0.25)
    for with_map in (False, True):
        results = tmp_path / f"map_{with_map}"
        results.mkdir()
        data = record if with_map else json.loads((REPO_RESULTS / "memory.json").read_text())
        (results / "memory.json").write_text(json.dumps(data))
        assert run(results, results / "README.md") == 0
        page = (results / "README.md").read_text()
        assert ("| analytic (map) |" in page) is with_map and ("reduction (map)" in page) is with_map
        if with_map:
            first = record["blocks"][0]
            assert f"| {nbytes(first['activation_bytes_map'])} |" in page and "| 25% |" in page
