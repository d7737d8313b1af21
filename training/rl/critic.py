"""PPO's critic: the policy's transformer body with a scalar value head, one value per token position.

The value at position t is read from the hidden state that predicts token t (aligned with
``token_logprobs``), so values on agent tokens estimate the return from just before each agent token.
Saved with the trainer state of a checkpoint as ``critic.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

CRITIC_FILE = "critic.safetensors"


class ValueModel(torch.nn.Module):
    """A transformer body plus a linear value head."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(body.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @classmethod
    def load(cls, folder: Path, device: torch.device, state_dir: Path | None = None) -> ValueModel:
        """The critic saved in ``state_dir`` (default ``folder``), or a new one whose body starts from the policy
        in ``folder``."""
        model = cls(AutoModel.from_pretrained(folder, dtype=torch.float32))
        saved = (state_dir or folder) / CRITIC_FILE
        if saved.exists():
            model.load_state_dict(load_file(saved))
        return model.to(device)

    def save(self, folder: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, folder / CRITIC_FILE)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        values = self.head(hidden).squeeze(-1)[:, :-1]
        return torch.nn.functional.pad(values, (1, 0))


@torch.no_grad()
def sequence_values(critic: ValueModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    micro_batch: int = 8) -> torch.Tensor:
    """Values of every position, in micro-batches, without gradients."""
    device = next(critic.parameters()).device
    out = [critic(input_ids[s:s + micro_batch].to(device), attention_mask[s:s + micro_batch].to(device)).cpu()
           for s in range(0, len(input_ids), micro_batch)]
    return torch.cat(out)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over agent tokens."""
    from training.rl.advantages import masked_mean

    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_diff = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    return float(1 - var_diff / var_returns) if var_returns > 0 else 0.0
