"""SciWorld (ScienceWorld) environment backend: the task index, sub-task labels and pooled simulator JVMs.

Task index (AgentGym's): ScienceWorld tasks ``1-1`` .. ``10-2`` minus {5-1, 5-2, 9-1, 9-2, 9-3, 10-1, 10-2},
flattened over every variation of each remaining task in task order; ``data_idx`` indexes this list
(4639 items with scienceworld 1.2.3; AgentGym's split uses 2120 + 200 of them). The list is frozen in
``data/sciworld/tasks.json`` (rows ``[index, task_id, task_name, variation]``), so ``num_items`` and
``sub_task`` need no JVM; :func:`freeze_tasks` regenerates it from a simulator.

Sub-tasks, the paper's 8 SciWorld subsets derived from ScienceWorld's task families (``tasks.json`` of
the scienceworld package gives the topics):

=============  ===============================================================  ======
sub_task       ScienceWorld tasks                                               items
=============  ===============================================================  ======
Matter         1-1 boil, 1-2 melt, 1-3 freeze, 1-4 change state (any)             120
Measure        2-1 use thermometer, 2-2/2-3 measure melting point (known/unknown)  1276
Electricity    3-1 power component, 3-2 renewable vs non-renewable energy           40
Test-Cond      3-3/3-4 test conductivity (known/unknown)                          1500
Find           4-1..4-4 find a living thing / non-living thing / plant / animal   1200
Chem-Mix       6-1..6-3 chemistry mix, mix paints (secondary/tertiary)             104
Lifespan       7-1..7-3 longest / shortest / longest-then-shortest lived           375
Identify       8-1/8-2 identify life stages (plant / animal)                        24
=============  ===============================================================  ======

Episode: reset takes a JVM from the pool (kept until close), loads (task, variation) with no
simplifications and performs ``look around``; the observation is the look-around text and ``info``
carries AgentGym's ``task_name``, ``var_num`` and ``task_description``. ``score`` is the simulator's
0..100 (-100 once the task failed), ``reward = clip(score / 100, 0, 1)``, ``success = score >= 100``,
``done`` when the simulator completes the task (success or failure) or the move count passes
``env_step_limit`` (ScienceWorld's default 100). ``available_actions`` lists the simulator's action
templates (``"open OBJ"``, ``"move OBJ to OBJ"``, ...) followed by ``"OBJ = <name>"`` for every object the
agent can refer to now: bounded, unlike the full action x object product (400-3000+ strings).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, NamedTuple

from envs import base
from envs.base import EpisodeFinishedError, StepResult
from envs.sciworld.jvm_pool import (
    DEFAULT_HEAP,
    DEFAULT_JAVA_OPTS,
    JVMPool,
    SimulatorActionError,
    SimulatorCrashedError,
    SimulatorJVM,
    java_options,
)

TASKS_FILE = Path(__file__).resolve().parents[2] / "data" / "sciworld" / "tasks.json"
EXCLUDED_TASKS: frozenset[str] = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
# Task id (or its family prefix before "-") -> the paper's SciWorld subset.
SUB_TASKS: dict[str, str] = {
    "1": "Matter",
    "2": "Measure",
    "3-1": "Electricity",
    "3-2": "Electricity",
    "3-3": "Test-Cond",
    "3-4": "Test-Cond",
    "4": "Find",
    "6": "Chem-Mix",
    "7": "Lifespan",
    "8": "Identify",
}
DEFAULT_STEP_LIMIT = 100


class Item(NamedTuple):
    """One entry of the flat task list."""

    index: int
    task_id: str
    task_name: str
    variation: int


def sub_task_of(task_id: str) -> str:
    """The paper's subset of a ScienceWorld task id such as ``"3-3"``."""
    label = SUB_TASKS.get(task_id) or SUB_TASKS.get(task_id.split("-")[0])
    if label is None:
        raise KeyError(f"ScienceWorld task {task_id} is not in the AgentGym task list (excluded or unknown)")
    return label


def normalised_reward(score: float) -> float:
    """AgentGym's 0..100 score (-100 on failure) as a reward in [0, 1]."""
    return min(max(score / 100.0, 0.0), 1.0)


def load_items(path: Path = TASKS_FILE) -> tuple[Item, ...]:
    """Read the frozen flat task list, checking that row i has index i."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: regenerate it with envs.sciworld.backend.freeze_tasks()")
    items = tuple(Item(*row) for row in json.loads(path.read_text())["items"])
    for i, item in enumerate(items):
        if item.index != i:
            raise ValueError(f"{path}: row {i} has index {item.index}; the list must be dense and in order")
    return items


def freeze_tasks(path: Path = TASKS_FILE, heap: str = DEFAULT_HEAP) -> int:
    """Enumerate tasks and variations with one simulator JVM and write ``path``; return the item count."""
    from scienceworld.constants import ID2TASK  # the package's task table, in task-id order

    jvm = SimulatorJVM(java_options(heap))
    try:
        tasks = [
            {"task_id": tid, "task_name": name, "variations": jvm.max_variations(name), "sub_task": sub_task_of(tid)}
            for tid, name in ID2TASK.items()
            if tid not in EXCLUDED_TASKS
        ]
    finally:
        jvm.close()
    rows = [[0, t["task_id"], t["task_name"], v] for t in tasks for v in range(t["variations"])]
    for i, row in enumerate(rows):
        row[0] = i
    import scienceworld

    header = {
        "source": f"scienceworld {scienceworld.__version__}",
        "excluded": sorted(EXCLUDED_TASKS, key=lambda t: [int(x) for x in t.split("-")]),
        "columns": list(Item._fields),
        "tasks": tasks,
    }
    body = ",\n".join(json.dumps(row) for row in rows)
    text = json.dumps(header, indent=1)[:-2] + ',\n "items": [\n' + body + "\n ]\n}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return len(rows)


class Backend(base.Backend):
    """Shared state of a SciWorld server: the frozen task list and the JVM pool (started lazily).

    Options (``--option key=value``): ``max_jvms`` (JVMs alive at most, one per instance between its
    reset and close; default 4), ``heap`` (the java heap flag, default ``-Xmx384m``; the initial heap is the
    same unless java_opts sets -Xms), ``java_opts`` (further java flags, default ``-XX:+UseSerialGC
    -XX:+AlwaysPreTouch -XX:ReservedCodeCacheSize=64m -XX:MaxMetaspaceSize=128m``: the memory a JVM holds is
    committed at its start and bounded), ``env_step_limit`` (moves before the simulator ends the episode,
    default 100).
    """

    name = "sciworld"
    parallel_steps = True  # one JVM per instance: a /step_batch steps them at the same time

    def __init__(
        self,
        max_jvms: int = 4,
        heap: str = DEFAULT_HEAP,
        java_opts: str = DEFAULT_JAVA_OPTS,
        env_step_limit: int = DEFAULT_STEP_LIMIT,
    ) -> None:
        self.items = load_items()
        self.env_step_limit = int(env_step_limit)
        self.pool = JVMPool(int(max_jvms), java_options(heap, java_opts))
        self.max_jvms = int(max_jvms)

    @property
    def capacity(self) -> int:
        return self.max_jvms

    @property
    def num_items(self) -> int:
        return len(self.items)

    def item(self, data_idx: int) -> Item:
        """The (task, variation) of ``data_idx``; raises DataIndexError when out of range."""
        self.check_index(data_idx)
        return self.items[data_idx]

    def sub_task(self, data_idx: int) -> str:
        return sub_task_of(self.item(data_idx).task_id)

    def new_instance(self) -> SciWorldEnv:
        return SciWorldEnv(self)

    def shutdown(self) -> None:
        self.pool.shutdown()


class SciWorldEnv(base.Environment):
    """One episode on a JVM taken from the backend's pool at the first reset and returned on close."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._jvm: SimulatorJVM | None = None
        self._item: Item | None = None
        self._observation = ""
        self._score = 0
        self._done = False
        self._closed = False
        self._lock = threading.Lock()  # close() may come from the reaper while nothing else runs

    def reset(self, data_idx: int) -> StepResult:
        item = self._backend.item(data_idx)
        self._item = None
        try:
            description, observation = self._load(item)
        except SimulatorCrashedError:
            # A JVM can die between episodes (e.g. OOM-killed): retry once on a fresh one.
            self._drop_jvm()
            description, observation = self._load(item)
        self._item, self._done = item, False
        self._observation = observation
        return self._result(
            observation, {"task_name": item.task_name, "var_num": item.variation, "task_description": description}
        )

    def _load(self, item: Item) -> tuple[str, str]:
        jvm = self._take_jvm()
        try:
            jvm.load(item.task_name, item.variation, "", False)
            description = jvm.task_description()
            observation = jvm.step("look around")
            self._score = jvm.score()
        except SimulatorActionError as err:
            raise RuntimeError(
                f"ScienceWorld could not load task {item.task_id} variation {item.variation}: {err}"
            ) from err
        return description, observation

    def _take_jvm(self) -> SimulatorJVM:
        with self._lock:
            if self._closed:
                raise EpisodeFinishedError("this SciWorld instance is closed: create a new one")
            if self._jvm is not None and not self._jvm.alive():
                self._backend.pool.discard(self._jvm)
                self._jvm = None
            if self._jvm is None:
                self._jvm = self._backend.pool.acquire()
            return self._jvm

    def _drop_jvm(self) -> None:
        with self._lock:
            if self._jvm is not None:
                self._backend.pool.discard(self._jvm)
                self._jvm = None

    def step(self, action: str) -> StepResult:
        if self._item is None or self._jvm is None:
            raise EpisodeFinishedError("no SciWorld episode is running: reset the instance first")
        if self._done:
            raise EpisodeFinishedError("the SciWorld episode is finished: reset or close the instance")
        jvm = self._jvm
        try:
            observation = jvm.step(action)
            self._score = jvm.score()
            moves, completed = jvm.num_moves(), jvm.completed()
        except SimulatorActionError as err:
            # A Java exception on a strange input is the action's fault, not the episode's: report it.
            self._observation = f"The simulator could not carry out '{action}' ({err}). Try a different action."
            return self._result(self._observation, {})
        except SimulatorCrashedError:
            self._item = None
            self._drop_jvm()
            raise
        self._done = completed or self._score < 0 or moves > self._backend.env_step_limit
        self._observation = observation
        return self._result(observation, {})

    def _result(self, observation: str, info: dict[str, Any]) -> StepResult:
        return StepResult(
            observation=observation,
            reward=normalised_reward(self._score),
            score=float(self._score),
            done=self._done,
            success=self._score >= 100,
            info=info,
        )

    def observe(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        if self._item is None or self._jvm is None:
            raise EpisodeFinishedError("no SciWorld episode is running: reset the instance first")
        try:
            templates, objects = self._jvm.action_templates(), self._jvm.objects()
        except SimulatorCrashedError:
            self._item = None
            self._drop_jvm()
            raise
        return sorted(templates) + [f"OBJ = {name}" for name in sorted(objects)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            jvm, self._jvm = self._jvm, None
        self._item = None
        if jvm is not None:
            self._backend.pool.release(jvm)
