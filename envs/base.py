"""The in-process environment interface that every environment server serves.

An environment package provides two classes:

* a :class:`Backend`, created once per server process, which owns what instances share (a recipe
  tree, a pool of JVMs, a browser) and knows the task index space (``num_items``, ``sub_task``);
* an :class:`Environment`, one per live instance, created by ``Backend.new_instance()``.

The server (``envs.server``) adds HTTP, ids, locks, limits and reaping on top; nothing here knows
about HTTP, so environments run and test in-process too.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class StepResult:
    """What one reset or step returns.

    ``reward`` is the trajectory's reward so far, normalised to [0, 1]: the last step's reward is the
    trajectory's terminal reward. ``score`` is the environment's own raw score beside it (BabyAI's
    cumulative success reward, SciWorld's 0..100, -100 on failure). ``done`` is true on success or when
    the environment itself ends the episode. ``info`` holds extra wire fields (e.g. SciWorld's
    ``task_name``) that are merged into the response.
    """

    observation: str
    reward: float = 0.0
    score: float = 0.0
    done: bool = False
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The JSON fields of a /reset or /step response (``info`` merged in at the top level)."""
        out = {
            "observation": self.observation,
            "reward": float(self.reward),
            "score": float(self.score),
            "done": bool(self.done),
            "success": bool(self.success),
        }
        out.update(self.info)
        return out


class EnvError(Exception):
    """Base class of the errors an environment raises on bad requests (mapped to HTTP statuses)."""

    status_code: ClassVar[int] = 400


class DataIndexError(EnvError):
    """``data_idx`` does not name a task of this environment."""

    status_code = 422


class TaskOptionError(EnvError):
    """A client-supplied task (``/create`` options) that the environment cannot run, with the reason."""

    status_code = 422


class EpisodeFinishedError(EnvError):
    """A step on an episode that is already done (or was never reset)."""

    status_code = 409


class CapacityError(EnvError):
    """The server (or a pool it owns, such as SciWorld's JVMs) is full; retry later."""

    status_code = 503


class Environment(abc.ABC):
    """One live episode. Not thread-safe: the server holds a lock per instance."""

    @abc.abstractmethod
    def reset(self, data_idx: int) -> StepResult:
        """Start the task ``data_idx``; the same index always gives the same task and text."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one (already parsed) action. Invalid actions return an explanatory observation."""

    @abc.abstractmethod
    def observe(self) -> str:
        """The current observation text."""

    @abc.abstractmethod
    def available_actions(self) -> list[str]:
        """The actions valid now (or the action templates, where the space is open)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most environments hold nothing
        """Free what the instance holds. Called exactly once by the server."""

    def reset_custom(self, **options: str) -> StepResult:
        """Start a task the client brought (its backend's ``create_options``) instead of one by index."""
        raise TaskOptionError(f"this environment takes no task options ({', '.join(options)})")

    def view(self, name: str) -> object:
        """One of its backend's extra read-only ``views`` of the episode (AgentGym's ``GET /<name>?id=``)."""
        raise KeyError(name)


class Backend(abc.ABC):
    """What one server process shares between its instances, plus the task index space."""

    name: ClassVar[str]
    #: AgentGym's TextCraft server resets on /create; such backends set this so /create does too.
    reset_on_create: ClassVar[bool] = False
    #: The field AgentGym's clients of this environment use for the instance id (``id`` or ``env_idx``).
    id_field: ClassVar[str] = "id"
    #: Steps cost well under a millisecond (pure Python): the server runs them on its event loop.
    fast_steps: ClassVar[bool] = False
    #: A batch's instances may be stepped at the same time (each its own simulator process, e.g. one JVM per
    #: SciWorld instance): ``/step_batch`` steps them on threads, so one slow simulator does not hold the others.
    parallel_steps: ClassVar[bool] = False
    #: Fields of ``POST /create`` that bring a task of the client's own (``Environment.reset_custom``).
    create_options: ClassVar[tuple[str, ...]] = ()
    #: Extra ``GET /<name>?id=`` endpoints AgentGym's server of this environment has (``Environment.view``).
    views: ClassVar[tuple[str, ...]] = ()

    @property
    @abc.abstractmethod
    def num_items(self) -> int | None:
        """Number of valid ``data_idx`` values (0..num_items-1); None when any index >= 0 is valid."""

    @abc.abstractmethod
    def new_instance(self) -> Environment:
        """A fresh, not yet reset instance."""

    @abc.abstractmethod
    def sub_task(self, data_idx: int) -> str:
        """The sub-task (category) label of ``data_idx``, used for splits and per-category metrics."""

    @property
    def capacity(self) -> int | None:
        """Live episodes the backend can hold at once (a simulator or browser pool), None if unbounded."""
        return None

    def check_index(self, data_idx: int) -> None:
        """Raise :class:`DataIndexError` naming the valid range when ``data_idx`` is out of it."""
        n = self.num_items
        if data_idx < 0 or (n is not None and data_idx >= n):
            valid = f"0..{n - 1}" if n is not None else ">= 0"
            raise DataIndexError(f"data_idx {data_idx} is out of range for {self.name}: valid {valid}")

    def problem(self) -> str | None:
        """What keeps the backend from serving (a helper process that died, ...), for ``/health``; None if fine."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release shared resources when the server stops."""
