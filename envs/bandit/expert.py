"""The bandit's expert opens the paying door."""

from __future__ import annotations

from envs.client import BaseEnvClient, StepOutput


def solve(client: BaseEnvClient, data_idx: int, max_turns: int = 1) -> StepOutput:
    client.reset(data_idx)
    return client.step("Thought: the right door pays.\nAction: right")
