"""Mistakes are found before any tiny asset is built, ``--dry-run`` builds none, and a build says what it builds.

Each test points $VLMRL_CACHE_DIR at an empty directory, as on a fresh clone, and runs ``vlmrl.main`` in
this process: a config error and a dry run start no Ray and read no model.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from vlmrl.main import main
from vlmrl.testing import resolvers
from vlmrl.testing.resolvers import AssetGroup, TinyResolver, build_missing

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("VLMRL_CACHE_DIR", str(cache))
    monkeypatch.chdir(REPO)  # the examples name their reward function and format prompt from the repo root
    return cache


def _built(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) if cache.exists() else []


@pytest.mark.parametrize("example", ["quickstart.yaml", "judge_quickstart.yaml"])
def test_a_one_key_mistake_on_an_empty_cache_fails_in_seconds_naming_the_key_and_building_nothing(
    empty_cache, capsys, example
):
    start = time.perf_counter()
    code = main([f"config=examples/{example}", "worker.actor.optim.lrr=1e-3", "data.val_files=/nowhere/val.parquet"])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2
    assert "worker.actor.optim.lrr: unknown key; did you mean worker.actor.optim.lr?" in err
    # A path that no ${tiny:...} builds is still checked; those the run would build are not reported missing.
    assert "data.val_files: /nowhere/val.parquet does not exist" in err
    assert "does not exist" not in err.replace("/nowhere/val.parquet does not exist", "")
    assert _built(empty_cache) == []
    assert seconds < 30, seconds  # building the quickstart's (and the judge's) tiny models first took minutes


def test_a_dry_run_on_an_empty_cache_builds_no_tiny_model_and_says_what_a_run_would_build(empty_cache, capsys):
    assert main(["config=examples/quickstart.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "not built yet (a run builds them first; --dry-run builds nothing)" in out
    assert "the quickstart's format-tuned tiny model and data" in out and "${tiny:quickstart_model_dir}" in out
    assert f"model_path: {empty_cache}/quickstart-assets-" in out  # the path it will have
    assert _built(empty_cache) == []


def test_the_resolver_after_main_builds_again(empty_cache):
    # main plans ${tiny:...} without building while it validates; later loads in the process build as before.
    main(["config=examples/quickstart.yaml", "worker.actor.optim.lrr=1e-3"])
    from omegaconf import OmegaConf

    assert OmegaConf.has_resolver("tiny")
    resolver = TinyResolver(build=False)
    resolver("model_dir")
    assert resolver.missing == ["tiny"] and resolver.pending() == (str(resolvers.GROUPS["tiny"].root(empty_cache)),)


def test_a_build_says_what_it_builds_on_one_line_and_its_progress_goes_to_the_log(tmp_path, monkeypatch, capfd):
    def ensure(cache: Path):
        root = resolvers.GROUPS["tiny"].root(cache)
        os.write(2, b"Writing model shards: 100%|##########| 1/1\n")  # as transformers' bars do, on fd 2
        print("format-tune step 1/100")  # and the builders' own lines on stdout
        root.mkdir(parents=True)
        (root / "COMPLETE").write_text("test\n")

    fake = AssetGroup("", ("model_dir",), "a fake tiny model", lambda c: c / "fake-assets", lambda r: None, ensure)
    monkeypatch.setitem(resolvers.GROUPS, "tiny", fake)
    monkeypatch.setattr(resolvers, "_group_of", lambda name: ("tiny", name))
    resolver = TinyResolver(build=False, cache_dir=tmp_path / "cache")
    with pytest.raises(AttributeError):  # the fake layout has no paths; the group is recorded first
        resolver("model_dir")
    log = tmp_path / "exp" / "run.log"
    build_missing(resolver, log)
    out, err = capfd.readouterr()
    (line,) = out.splitlines()
    assert line.startswith("vlmrl: building a fake tiny model (the config names ${tiny:model_dir}) into ")
    assert f"progress in {log}" in line and err == ""
    text = log.read_text()
    assert "Writing model shards" in text and "format-tune step 1/100" in text and "tiny assets built in" in text
    assert resolver.cache().joinpath("fake-assets", "COMPLETE").is_file()


def test_a_run_builds_what_is_missing_after_validation_then_checks_what_needed_the_built_files(
    empty_cache, tmp_path, capfd
):
    # The tiny random model and data only (seconds): an override_config entry the model lacks is found once its
    # config.json exists, after the build; the run stops there, before Ray.
    yaml = tmp_path / "tiny.yaml"
    yaml.write_text(
        "data: {train_files: '${tiny:train_file}', val_files: '', prompt_key: problem, answer_key: answer, "
        "image_key: images}\n"
        "worker:\n  actor: {model: {model_path: '${tiny:model_dir}', override_config: {no_such_entry: 1}}}\n"
        "  reward: {reward_function: 'reward_functions/synthetic_colour.py:compute_score'}\n"
        f"trainer: {{output_dir: '{tmp_path / 'out'}'}}\n"
    )
    assert main([f"config={yaml}"]) == 2
    out, err = capfd.readouterr()
    (line,) = out.splitlines()
    log = tmp_path / "out" / "vlmrl" / "default" / "run.log"
    assert line.startswith("vlmrl: building the tiny random Qwen2.5-VL and its synthetic data (seconds) (the config "
                           "names ${tiny:train_file}, ${tiny:model_dir})")  # fmt: skip
    assert line.endswith(f"(progress in {log})")
    assert "Writing model shards" not in out + err and "Writing model shards" in log.read_text()
    assert "override_config.no_such_entry" in err and "has no entry 'no_such_entry'" in err
    assert _built(empty_cache) == [f"tiny-assets-{resolvers.assets.assets_version()}"]
