"""The bandit backend: one turn, two arms, ``right`` pays 1."""

from __future__ import annotations

from envs import base

OBSERVATION = "Two doors: left and right. Choose one."
ARMS = ("left", "right")


class BanditEnv(base.Environment):
    """One episode: a single choice."""

    def __init__(self) -> None:
        self.observation = ""

    def reset(self, data_idx: int) -> base.StepResult:
        self.observation = OBSERVATION
        return base.StepResult(OBSERVATION)

    def step(self, action: str) -> base.StepResult:
        arm = action.strip().lower()
        if arm not in ARMS:
            self.observation = f"'{action}' is not a door: choose left or right."
            return base.StepResult(self.observation, done=True)
        paid = arm == "right"
        self.observation = f"You opened the {arm} door: {'a prize!' if paid else 'nothing.'}"
        return base.StepResult(self.observation, reward=float(paid), score=float(paid), done=True, success=paid)

    def observe(self) -> str:
        return self.observation

    def available_actions(self) -> list[str]:
        return list(ARMS)


class Backend(base.Backend):
    """Any number of identical items."""

    name = "bandit"
    fast_steps = True

    @property
    def num_items(self) -> int:
        return 96

    def new_instance(self) -> BanditEnv:
        return BanditEnv()

    def sub_task(self, data_idx: int) -> str:
        return "bandit"
