"""BabyAI server backend: AgentGym's 40 minigrid BabyAI levels, played through text and high-level actions.

``data_idx`` picks ``LEVELS[data_idx % 40]`` with minigrid seed ``data_idx // 40`` (any index >= 0 is
valid). After reset the observation is ``"Your goal: <mission>\\n<description>\\nAvailable actions:
[...]"``; after a step the same without the goal line (``envs.babyai.text`` builds both and expands
the high-level actions into minigrid primitives). An impossible or unknown action returns the reason
plus the action list and changes nothing (minigrid is not stepped).

Reward: minigrid's success reward ``1 - 0.9 * step_count / max_steps`` (0 unless the mission
succeeded); it is already in [0, 1], so ``reward`` and ``score`` (AgentGym's cumulative value, read by
its clients) are equal. ``success`` = terminated with a positive reward; ``done`` = terminated or
truncated by minigrid (its own step limit, counted in primitive steps).

Each instance owns its minigrid env, whose generator is reseeded by ``reset(seed=...)``: the same
``data_idx`` gives the same episode whatever other threads do. ``close`` drops the env; nothing is
cached per instance or per level.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import gymnasium
import minigrid  # noqa: F401 - importing minigrid registers the BabyAI env ids with gymnasium
import minigrid.envs.babyai.core.roomgrid_level as _roomgrid_level
from gymnasium.envs.registration import load_env_creator

from envs import base
from envs.babyai import text, view

_LOG = logging.getLogger(__name__)

# AgentGym's 40 levels in its order (agentenv-babyai's level table, keys 1..40; its reset takes
# table[data_idx % 40 + 1], i.e. this tuple's [data_idx % 40]). All are minigrid BabyAI ids; the one
# change: AgentGym's "BabyAI-GoToObjS6-v0" is registered by minigrid 3.x as "BabyAI-GoToObjS6-v1"
# (the same GoToObj level with room_size=6).
LEVELS: tuple[str, ...] = (
    "BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0",
    "BabyAI-GoToObjS6-v1", "BabyAI-GoToLocalS8N7-v0", "BabyAI-GoToObjMazeS7-v0", "BabyAI-GoToImpUnlock-v0",
    "BabyAI-GoToSeqS5R2-v0", "BabyAI-GoToRedBlueBall-v0", "BabyAI-GoToDoor-v0", "BabyAI-GoToObjDoor-v0",
    "BabyAI-Open-v0", "BabyAI-OpenRedDoor-v0", "BabyAI-OpenDoorLoc-v0", "BabyAI-OpenRedBlueDoorsDebug-v0",
    "BabyAI-OpenDoorsOrderN4Debug-v0", "BabyAI-Pickup-v0", "BabyAI-UnblockPickup-v0", "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0", "BabyAI-PickupAbove-v0", "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0", "BabyAI-Unlock-v0", "BabyAI-UnlockLocalDist-v0", "BabyAI-KeyInBox-v0",
    "BabyAI-UnlockPickupDist-v0", "BabyAI-BlockedUnlockPickup-v0", "BabyAI-UnlockToUnlock-v0",
    "BabyAI-ActionObjDoor-v0", "BabyAI-FindObjS7-v0", "BabyAI-KeyCorridorS6R3-v0", "BabyAI-OneRoomS20-v0",
    "BabyAI-MoveTwoAcrossS8N9-v0", "BabyAI-SynthS5R2-v0", "BabyAI-SynthLoc-v0", "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0", "BabyAI-BossLevel-v0", "BabyAI-BossLevelNoUnlock-v0",
)

# The 6 reported sub-tasks, by the minigrid module that defines each level (goto, open, pickup,
# putnext, unlock; other + synth -> Other): 11 + 5 + 5 + 2 + 6 + 11 levels.
SUB_TASKS: tuple[str, ...] = ("GoTo", "Pickup", "Open", "Unlock", "PutNext", "Other")
_FAMILY: tuple[str, ...] = ("GoTo",) * 11 + ("Open",) * 5 + ("Pickup",) * 5 + ("PutNext",) * 2 + (
    "Unlock",) * 6 + ("Other",) * 11

NOT_STARTED = "The episode has not started: reset it with a data_idx first."
FINISHED = "The episode is over: reset the instance to play again."
COMPLETED = "The task is completed."
TRUNCATED = "The episode is over: the step limit was reached."
FAILED = "The episode is over: the mission failed."


def _quiet_print(*args: object, **_: object) -> None:
    _LOG.debug(" ".join(str(a) for a in args))


# minigrid's level generator prints "Sampling rejected: ..." on every rejected draw. Rebinding `print`
# in that one module's globals silences it for every thread without touching sys.stdout or fd 1
# (a global redirect would race with the server's other threads).
_roomgrid_level.print = _quiet_print  # type: ignore[attr-defined]


def level_of(data_idx: int) -> tuple[str, int]:
    """The minigrid level id and seed of ``data_idx``."""
    return LEVELS[data_idx % len(LEVELS)], data_idx // len(LEVELS)


def _factory(level: str) -> tuple[Callable[..., object], dict]:
    spec = gymnasium.spec(level)
    return load_env_creator(spec.entry_point), dict(spec.kwargs)  # type: ignore[arg-type]


# Level id -> (env class, kwargs), resolved once: shared, read-only, and cheaper than gymnasium.make.
_FACTORIES = {level: _factory(level) for level in LEVELS}


def make_env(level: str) -> object:
    """A fresh minigrid env of ``level``, without gymnasium's wrappers (their checks cost on every step), its view
    computed in one pass (``envs.babyai.view``: minigrid's own, cell for cell, in a third of the time)."""
    cls, kwargs = _FACTORIES[level]
    return view.install(cls(**kwargs))


def ending_of(done: bool, terminated: bool, success: bool) -> str:
    """The line announcing how the episode ended ("" while it runs)."""
    if not done:
        return ""
    return COMPLETED if success else FAILED if terminated else TRUNCATED


def normalise(action: str) -> str:
    """Lower-case and collapse whitespace (the client sends AgentGym's plain form already)."""
    return " ".join(action.lower().split())


class BabyAIEnv(base.Environment):
    """One BabyAI episode: a minigrid env plus the scene (text, actions, targets) of its current state."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._env: object | None = None
        self._level = ""
        self._scene: text.Scene | None = None
        self._obs = NOT_STARTED
        self._reward = 0.0
        self._done = True
        self._success = False

    def reset(self, data_idx: int) -> base.StepResult:
        self._backend.check_index(data_idx)
        level, seed = level_of(data_idx)
        if self._env is None or level != self._level:  # reseeding makes reuse deterministic
            self._env, self._level = make_env(level), level
        obs, _ = self._env.reset(seed=seed)  # type: ignore[attr-defined]
        self._scene = text.scene(self._env, obs["image"])
        self._reward, self._done, self._success = 0.0, False, False
        self._obs = self._scene.observation(self._env.mission)  # type: ignore[attr-defined]
        return base.StepResult(self._obs, info={"deleted": False, "level": level, "seed": seed})

    def step(self, action: str) -> base.StepResult:
        if self._done or self._scene is None:
            raise base.EpisodeFinishedError(NOT_STARTED if self._scene is None else FINISHED)
        env, act = self._env, normalise(action)
        if act == text.CHECK:
            self._obs = self._scene.observation()
            return self._result()
        plan = text.expand(env, act, self._scene)
        if isinstance(plan, str):
            self._obs = f"{plan}\n{self._scene.actions_line()}"
            return self._result()
        image, terminated = self._run(plan)
        self._scene = text.scene(env, image)
        self._obs = self._scene.observation(ending=ending_of(self._done, terminated, self._success))
        return self._result()

    def _run(self, plan: list[int]) -> tuple[object, bool]:
        """Step minigrid through ``plan`` (never empty), stopping when the episode ends."""
        for primitive in plan:
            obs, reward, terminated, truncated, _ = self._env.step(primitive)  # type: ignore[attr-defined]
            if terminated or truncated:
                self._done = True
                self._success = bool(terminated and reward > 0)
                self._reward = float(reward) if self._success else 0.0
                break
        return obs["image"], terminated

    def _result(self) -> base.StepResult:
        return base.StepResult(self._obs, self._reward, self._reward, self._done, self._success)

    @property
    def minigrid(self) -> object | None:
        """The unwrapped minigrid env (for tests and benchmarks to inspect; None before reset or after close)."""
        return self._env

    def observe(self) -> str:
        return self._obs

    def available_actions(self) -> list[str]:
        return list(self._scene.actions) if self._scene is not None else []

    def close(self) -> None:
        if self._env is not None:
            self._env.close()  # type: ignore[attr-defined]
        self._env = self._scene = None
        self._done = True


class Backend(base.Backend):
    """Stateless apart from the level table: every instance owns its minigrid env."""

    name = "babyai"
    fast_steps = True  # ~0.14 ms a step: cheaper on the event loop than a thread hop

    @property
    def num_items(self) -> int | None:
        return None

    def new_instance(self) -> BabyAIEnv:
        return BabyAIEnv(self)

    def sub_task(self, data_idx: int) -> str:
        """One of ``SUB_TASKS``: the family of ``LEVELS[data_idx % 40]``."""
        self.check_index(data_idx)
        return _FAMILY[data_idx % len(LEVELS)]
