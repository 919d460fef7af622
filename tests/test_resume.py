"""Checkpoints end to end: exact resume, a crash during a save, SIGTERM, save_limit, val_only and export.

Every run is ``python -m vlmrl.main`` on the tiny quickstart, cut down to
seconds per step (tests/helpers/runs.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.trajectories import Response, batch_of
from helpers.runs import (
    E2E_STEPS,
    E2E_TRAINING,
    SMALL,
    experiment_dir,
    logging_reward,
    read_metrics,
    run_command,
    run_main,
    tail,
)
from safetensors.torch import load_file

STEPS = E2E_STEPS
# What must match between an uninterrupted run and a resumed one.
COMPARED = ["reward/overall", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"]


@pytest.fixture(scope="module")
def uninterrupted(e2e_run):
    """The shared run: 4 steps in one go, saving every 2 steps and keeping only the newest checkpoint."""
    return e2e_run.output_dir


@pytest.fixture(scope="module")
def crashed_then_resumed(tiny_assets, tmp_path_factory):
    """The shared run's training, killed in the middle of saving step 3, then started again with the same command.

    Validation and TensorBoard are left out: they do not change what is trained.
    """
    tmp = tmp_path_factory.mktemp("resumed")
    out = tmp / "outputs"
    args = (
        *E2E_TRAINING, *logging_reward(tmp), "data.val_files=", "trainer.val_before_train=false",
        "trainer.logger=[console,file,mlflow]", "trainer.save_freq=1",
    )  # fmt: skip
    crashed = run_main(out, *args, experiment="e2e", crash_in_save_at=3)
    # The fault injection (tests/helpers/crash_in_save.py) SIGKILLs the Runner actor mid-save: the run must end
    # with the Runner's death, not with an error of its own before the save.
    assert crashed.returncode != 0 and "class_name: Runner" in crashed.stdout + crashed.stderr, tail(crashed)
    checkpoints = experiment_dir(out, "e2e") / "checkpoints"
    debris = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(".global_step_3.tmp-"))
    assert debris, sorted(p.name for p in checkpoints.iterdir())
    resumed = run_main(out, *args, experiment="e2e")
    assert resumed.returncode == 0, tail(resumed)
    return out, resumed.stdout + resumed.stderr, debris


def test_a_resumed_run_repeats_the_uninterrupted_one(uninterrupted, crashed_then_resumed):
    resumed_out, _log, _debris = crashed_then_resumed
    # The shared run also logs its validation before training as step 0.
    expected = [m for m in read_metrics(uninterrupted, "e2e") if m["step"] > 0]
    got = read_metrics(resumed_out, "e2e")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for e, g in zip(expected, got):
        for key in COMPARED:
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (e["step"], key)
    # Same data order: the resumed steps saw the same prompts, so the same rewards; and
    # the final weights are the same.
    final_a = load_file(experiment_dir(uninterrupted, "e2e") / "checkpoints" / f"global_step_{STEPS}" / "actor" / "huggingface" / "model.safetensors")
    final_b = load_file(experiment_dir(resumed_out, "e2e") / "checkpoints" / f"global_step_{STEPS}" / "actor" / "huggingface" / "model.safetensors")
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=1e-5, atol=1e-6)


def test_a_crash_during_a_save_resumes_from_the_previous_complete_checkpoint(crashed_then_resumed):
    out, log, debris = crashed_then_resumed
    assert "resumed from" in log and "global_step_2 at step 2" in log
    assert "training (resumed at step 2)" in log  # the progress bar starts at the resumed step
    # The interrupted save's temporary directory is removed at start (the run lock makes it this run's own).
    checkpoints = experiment_dir(out, "e2e") / "checkpoints"
    assert all(f"removing {checkpoints / name}, left by a save that was killed" in log for name in debris), log[-5000:]
    assert not any((checkpoints / name).exists() for name in debris)
    assert (checkpoints / "global_step_3" / "COMPLETE").is_file()  # saved again by the resumed run


def test_save_limit_keeps_only_the_newest_checkpoint(uninterrupted):
    checkpoints = experiment_dir(uninterrupted, "e2e") / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"global_step_{STEPS}"]


def test_sigterm_finishes_the_step_saves_and_exits_zero(sigterm_run):
    # The quickstart (SMALL steps, max_steps=200) sent SIGTERM once its first step was logged; the run is
    # shared with tests/faults/test_sigterm_through_launch_script.py (tests/helpers/sigterm_run.py): the driver
    # is started by a launch script that execs it, so the signal is the driver's own.
    output = sigterm_run.output
    assert sigterm_run.returncode == 0, output[-5000:]
    logged = read_metrics(sigterm_run.out)
    last = logged[-1]["step"]
    assert last < 200
    checkpoint = experiment_dir(sigterm_run.out) / "checkpoints" / f"global_step_{last}"
    assert (checkpoint / "COMPLETE").is_file(), output[-5000:]
    assert "stop requested" in output


def test_val_only_validates_the_resumed_checkpoint_and_trains_nothing(uninterrupted, tiny_assets):
    checkpoint = experiment_dir(uninterrupted, "e2e") / "checkpoints" / f"global_step_{STEPS}"
    out = uninterrupted.parent / "val_only"
    proc = run_main(
        out, *SMALL, f"data.val_files={tiny_assets.val_file}", "trainer.val_only=true",
        f"trainer.load_checkpoint_path={checkpoint}",
        # Two sampled responses per prompt, so this run also shows verl's mean@N, best@N and maj@N end to end;
        # two prompts per validation batch, so a prompt's responses must be told apart across batches.
        "worker.rollout.val_override_config.n=2", "worker.rollout.val_override_config.temperature=1.0",
        "data.val_batch_size=2",
    )  # fmt: skip
    assert proc.returncode == 0, tail(proc)
    logged = read_metrics(out)
    assert [m["step"] for m in logged] == [STEPS]
    assert "val/reward/overall" in logged[0] and "actor/pg_loss" not in logged[0]
    means = {k.removesuffix("/overall/mean@2"): v for k, v in logged[0].items() if k.endswith("/overall/mean@2")}
    assert means, sorted(logged[0])
    for source, mean in means.items():  # source: "val/<data source>"
        # Every prompt has 2 responses, so the mean over prompts of their means is the plain mean over responses.
        assert mean == pytest.approx(logged[0][f"{source}/overall"])
        assert logged[0][f"{source}/overall/best@2"] >= mean
        assert f"{source}/overall/maj@2" in logged[0]
    assert not (experiment_dir(out) / "checkpoints").exists()


def test_export_writes_the_checkpointed_actor_as_a_hf_model(uninterrupted, tmp_path):
    checkpoint = experiment_dir(uninterrupted, "e2e") / "checkpoints" / f"global_step_{STEPS}"
    exported = tmp_path / "exported"
    proc = run_command(
        [sys.executable, "-m", "vlmrl.export", str(checkpoint / "actor"), "--output", str(exported)], timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "processor_config.json"):
        assert (exported / name).is_file(), name
    # The weights are the actor's: equal to the full weights the trainer wrote at its last step.
    weights = load_file(exported / "model.safetensors")
    reference = load_file(checkpoint / "actor" / "huggingface" / "model.safetensors")
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in weights)
    # vLLM loads it, and its greedy tokens are the argmax of the exported model's own logits.
    vllm = run_command(
        [sys.executable, "tests/helpers/vllm_greedy.py", str(exported), str(_val_file()), "0:6", "1:6"], timeout=300
    )
    assert vllm.returncode == 0, vllm.stderr[-3000:]
    greedy = json.loads(next(line for line in vllm.stdout.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))
    _assert_hf_argmax_matches(exported, greedy)


def _val_file() -> Path:
    from vlmrl.testing.assets import ensure_tiny_assets

    return ensure_tiny_assets().val_file


def _assert_hf_argmax_matches(model_dir: Path, greedy: list[dict]) -> None:
    """Teacher-force each greedy response through the HF model; every token must be the argmax."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.validate import load_config
    from vlmrl.data.dataset import RLHFDataset
    from vlmrl.records import PromptSample
    from vlmrl.rollout.engine.sampling import sampling_mask
    from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
    from vlmrl.train.micro_batches import merged_mm_inputs

    data = load_config(["config=examples/quickstart.yaml"]).data
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    dataset = RLHFDataset(
        str(_val_file()), processor, prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key,
        image_dir=None, max_prompt_length=data.max_prompt_length, min_pixels=data.min_pixels,
        max_pixels=data.max_pixels, format_prompt=data.format_prompt,
    )  # fmt: skip
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    for g in greedy:
        sample: PromptSample = dataset.sample(g["row"])
        batch = batch_of(
            [Response(sample, 0, g["ids"], "", None)],
            max_prompt_length=data.max_prompt_length, max_response_length=len(g["ids"]),
            pad_token_id=processor.tokenizer.pad_token_id,
        )  # fmt: skip
        with torch.no_grad():
            logits = model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids.transpose(0, 1), logits_to_keep=len(g["ids"]) + 1,
                **merged_mm_inputs(batch),
            ).logits[0, :-1]  # fmt: skip
        predicted = logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
        assert predicted == g["ids"], (g["row"], predicted, g["ids"])


def test_a_resumed_run_continues_its_mlflow_run(crashed_then_resumed):
    from mlflow import MlflowClient

    out, _log, _debris = crashed_then_resumed
    experiment = experiment_dir(out, "e2e")
    client = MlflowClient(tracking_uri=f"sqlite:///{experiment / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    history = client.get_metric_history(runs[0].info.run_id, "reward/overall")
    assert sorted({m.step for m in history}) == list(range(1, STEPS + 1))
    assert runs[0].info.status == "FINISHED"
