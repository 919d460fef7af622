"""Values derived from the config, computed once and never written back into it.

EasyR1 multiplies batch sizes in place on a worker's copy of the config, so
the same key means different things in different processes. Here the user's
numbers stay as written and every derived number lives in ``Plan``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlmrl.config import Config


def world_size(config: Config) -> int:
    return config.trainer.n_gpus_per_node * config.trainer.nnodes


@dataclass(frozen=True)
class Plan:
    world_size: int
    samples_per_step: int
    """Rollout samples per step: data.rollout_batch_size x worker.rollout.n."""
    samples_per_update: int
    """Samples per optimizer step (one mini-batch), over all workers."""
    updates_per_step: int
    """Optimizer steps per training step: mini-batches x ppo_epochs."""
    micro_batches_per_update: int
    """Gradient-accumulation micro-batches per optimizer step, per worker."""
    use_reference: bool
    """Whether a frozen reference model is built and run (the KL term needs it)."""
    experiment_dir: str
    checkpoint_dir: str

    def as_dict(self) -> dict:
        return asdict(self)


def resolve(config: Config) -> Plan:
    world = world_size(config)
    n = config.worker.rollout.n
    actor = config.worker.actor
    samples_per_step = config.data.rollout_batch_size * n
    samples_per_update = actor.global_batch_size * n
    experiment_dir = Path(config.trainer.output_dir) / config.trainer.project_name / config.trainer.experiment_name
    checkpoint_dir = config.trainer.save_checkpoint_path or str(experiment_dir / "checkpoints")
    return Plan(
        world_size=world,
        samples_per_step=samples_per_step,
        samples_per_update=samples_per_update,
        updates_per_step=(samples_per_step // samples_per_update) * actor.ppo_epochs,
        micro_batches_per_update=samples_per_update // world // actor.micro_batch_size_per_device_for_update,
        use_reference=config.algorithm.use_kl_loss and not config.algorithm.disable_kl,
        experiment_dir=str(experiment_dir.resolve()),
        checkpoint_dir=str(Path(checkpoint_dir).resolve()),
    )
