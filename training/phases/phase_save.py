"""What a phase's checkpoint holds and how it is written (``training.phases.trainer``): the actor's weights (LoRA
adapters merged, the adapter beside them), the tokenizer, the training state (optimizer partitions, RNG, data position,
curriculum and guard history), the record of the manifest and, for the final one, the model card; written whole or
not at all (``training.checkpoint``). A part of :class:`training.phases.trainer.PhaseTrainer`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from training.checkpoint import STATE, model_card, prepare_staging, prune, staging_folder, write_checkpoint
from training.guard import lr_scale
from training.lora import save_lora
from training.phases.phase_files import LOGS, snapshot_logs


@dataclass
class Ledger:
    """What a phase cost."""

    generated_tokens: int = 0
    trained_tokens: int = 0
    wall_seconds: float = 0.0
    devices: int = 1
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def device_hours(self) -> float:
        return self.wall_seconds * self.devices / 3600

    def as_dict(self) -> dict[str, float]:
        return {"generated_tokens": self.generated_tokens, "trained_tokens": self.trained_tokens,
                "wall_seconds": round(self.wall_seconds, 3), "device_hours": round(self.device_hours, 6)}


class PhaseCheckpoints:
    """Writes the phase's intermediate and final checkpoints (mixed into ``PhaseTrainer``)."""

    out_dir: Path
    config: Any
    strategy: Any
    leader: bool

    def _save_weights(self, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> str | None:
        """The actor's weights (``weights``, when gathered from ZeRO-3 partitions) as a plain model folder (LoRA
        adapters merged in, the actor unchanged); with LoRA, the adapter in lora/ and its sha256 returned."""
        if self.config.lora is not None:
            return save_lora(self.model, folder)
        self.strategy.save_model(folder, weights)
        return None

    def save(self, name: str) -> Path:
        folder = self.out_dir / name
        state = {
            "global_step": self.global_step,
            # a prefetched rollout is not kept: a resumed run takes its items again (and samples them on-policy)
            "data_position": self.data.position - (self.config.batch_items if self.prefetched is not None else 0),
            "rng": {"torch": torch.get_rng_state()},
            "adaptive_history": self.history,
            # as JSON text: pickling the rows' floats would depend on which objects they share, so a resumed run's
            # state file would differ in bytes from an uninterrupted one's
            "guard_history": json.dumps(self.guard.history),
            **({"critic_optimizer": self.critic_optimizer.state_dict()} if self.critic_optimizer else {}),
            "reference": str(self.reference_path),
        }
        record: dict[str, Any] = {
            "env": self.env, "phase": self.phase, "h": self.h, "steps": self.steps, "global_step": self.global_step,
            "phase_first_step": self.first_step, "algorithm": self.config.algorithm, "seed": self.config.seed,
            "config": self.config.model_dump(), "parent": self.parent, "kind": name.split("/")[0],
            "cost": self.ledger.as_dict(),
            "engine": {"name": self.config.engine, **({"served": self.sync.version.as_dict(), "syncs": self.sync.syncs}
                                                     if self.sync is not None and self.sync.version else {})},
            "curriculum": {"mode": "adaptive" if self.adaptive else "planned", "planned_steps": self.steps,
                           "budget": self.budget, "trained_steps": self.global_step - self.first_step,
                           "unused_steps": self.end_step - self.global_step if self.advanced else 0,
                           "advanced_early": self.advanced,
                           "ended_by_guard": self.stop_at is not None},
            "guard": {"events": [e.model_dump() for e in self.events],
                      "lr_scale": lr_scale(self.events, self.global_step, self.config.guard.lr_factor)},
        }

        weights = self.strategy.gather_weights()  # every rank takes part (ZeRO-3); rank 0 writes them

        def write(tmp: Path) -> None:
            adapter = self._save_weights(tmp, weights)  # with LoRA: merged weights (a plain HF folder) and lora/
            if adapter is not None:
                record["lora"] = {"adapter_sha256": adapter}
            self.tokenizer.save_pretrained(tmp)
            if name == "final":
                (tmp / "README.md").write_text(model_card(record, self.last_stats))
            torch.save(state, tmp / STATE)
            if name.startswith("intermediate"):
                snapshot_logs(self.out_dir, tmp / LOGS)
            if self.critic is not None:
                self.critic.save(tmp)

        # Every rank writes its optimizer partition into one shared staging folder; rank 0 adds the rest,
        # the manifest, and renames it into place (so the checkpoint appears whole or not at all).
        tmp = staging_folder(folder, shared=self.strategy.world_size > 1)
        if self.leader:
            prepare_staging(tmp)
        self.strategy.barrier()
        torch.save(self.strategy.optimizer_state(), tmp / f"optimizer_rank{self.strategy.rank}.pt")
        self.strategy.barrier()
        if self.leader:
            write_checkpoint(folder, write, record, tmp=tmp, export=name == "final")
            if name.startswith("intermediate"):
                prune(self.out_dir / "intermediate", self.config.keep_checkpoints)
        self.strategy.barrier()
        return folder
