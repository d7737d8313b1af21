"""SciWorld: the frozen task index, episodes on pooled JVMs, the client's conventions, and the gold-path
expert through a real HTTP server (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from scienceworld.constants import ID2TASK

from envs.base import CapacityError, DataIndexError, EpisodeFinishedError
from envs.react import ActionParseError
from envs.sciworld import expert
from envs.sciworld.backend import EXCLUDED_TASKS, TASKS_FILE, Backend, freeze_tasks, normalised_reward
from envs.sciworld.client import ACTIONS, Client, Spec
from envs.sciworld.jvm_pool import SimulatorCrashedError, java_options

ROOT = Path(__file__).resolve().parent.parent
JAVA_TOOL_OPTIONS = os.environ.get("JAVA_TOOL_OPTIONS")
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="SciWorld needs Java (java not on PATH)")
SUBSETS = {"Matter", "Measure", "Electricity", "Test-Cond", "Find", "Chem-Mix", "Lifespan", "Identify"}


def first_index(backend: Backend, task_id: str) -> int:
    return next(item.index for item in backend.items if item.task_id == task_id)


def java_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.name() == "java"}


@pytest.fixture(scope="module")
def backend():
    b = Backend(max_jvms=2)
    yield b
    b.shutdown()


@pytest.fixture
def env(backend):
    e = backend.new_instance()
    yield e
    e.close()


# ---------------------------------------------------------------- task index (no JVM)


def test_flat_list_size_order_and_exclusions() -> None:
    before = java_children()
    b = Backend()
    assert b.num_items == 4639  # AgentGym's split draws 2120 + 200 = 2320 of these
    ids = [item.task_id for item in b.items]
    assert not EXCLUDED_TASKS & set(ids)
    assert list(dict.fromkeys(ids)) == [t for t in ID2TASK if t not in EXCLUDED_TASKS]  # task order
    counts = Counter(ids)
    assert (counts["1-1"], counts["2-1"], counts["3-3"], counts["8-2"]) == (30, 540, 900, 10)
    for task_id, n in counts.items():  # variations 0..n-1, contiguous and in order
        assert [i.variation for i in b.items if i.task_id == task_id] == list(range(n))
    assert (b.items[0].task_name, b.items[-1].task_name) == ("boil", "identify-life-stages-2")
    labels = {b.sub_task(i) for i in range(b.num_items)}
    assert labels == SUBSETS
    assert b.sub_task(first_index(b, "3-2")) == "Electricity" and b.sub_task(first_index(b, "3-3")) == "Test-Cond"
    assert b.pool.stats()["launched"] == 0 and java_children() == before  # no JVM until a reset


def test_out_of_range_index_is_rejected_without_a_jvm() -> None:
    b = Backend(max_jvms=1)
    e = b.new_instance()
    for idx in (-1, b.num_items, 10**6):
        with pytest.raises(DataIndexError, match=r"valid 0\.\.4638"):
            e.reset(idx)
        with pytest.raises(DataIndexError):
            b.sub_task(idx)
    assert b.pool.stats()["launched"] == 0


def test_java_options_keep_the_heap_on_the_command_line() -> None:
    assert java_options() == ["-Xmx384m", "-Xms384m", "-XX:+UseSerialGC", "-XX:+AlwaysPreTouch",
                              "-XX:ReservedCodeCacheSize=64m", "-XX:MaxMetaspaceSize=128m"]
    assert java_options(512, "") == java_options("512m", "") == java_options("-Xmx512m", "") == ["-Xmx512m", "-Xms512m"]
    assert java_options(512, "-Xms64m") == ["-Xmx512m", "-Xms64m"]  # an initial heap of one's own stays


def test_reward_normalisation() -> None:
    assert [normalised_reward(s) for s in (-100, 0, 8, 50, 100, 130)] == [0.0, 0.0, 0.08, 0.5, 1.0, 1.0]


# ---------------------------------------------------------------- client (no server)


def test_client_prompt_and_action_cleaning() -> None:
    spec = Spec()
    prompt = Spec.conversation_start[0]["value"]
    assert len(ACTIONS) == 25 and all(template in prompt for template, _ in ACTIONS)
    assert "Thought:" in prompt and "Action:" in prompt and Spec.conversation_start[1]["from"] == "gpt"
    assert spec.parse("Thought: go.\nAction: go to kitchen</s>") == "go to kitchen"
    assert spec.clean_action("  open door to kitchen </s>  ") == "open door to kitchen"
    with pytest.raises(ActionParseError):
        spec.parse("Thought: hm\nAction: </s>")
    payload = {"task_description": "Your task is X.", "observation": "A room."}
    assert spec.format_reset(payload) == "Your task is X.\nA room."


def test_client_module_does_not_import_the_simulator() -> None:
    code = "import sys, envs.sciworld.client; assert not {'scienceworld', 'py4j'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


# ---------------------------------------------------------------- episodes on JVMs


@needs_java
def test_frozen_list_matches_the_simulator(tmp_path) -> None:
    path = tmp_path / "tasks.json"
    assert freeze_tasks(path) == 4639
    assert json.loads(path.read_text()) == json.loads(TASKS_FILE.read_text())


@needs_java
def test_reset_fields_and_jvm_options(backend, env) -> None:
    first = env.reset(first_index(backend, "1-1"))
    assert first.observation.startswith("This room is called")
    assert first.info["task_name"] == "boil" and first.info["var_num"] == 0
    assert first.info["task_description"].startswith("Your task is to boil water")
    assert (first.reward, first.score, first.done, first.success) == (0.0, 0.0, False, False)
    assert env.observe() == first.observation
    cmdline = psutil.Process(env._jvm.pid).cmdline()
    assert {"-Xmx384m", "-Xms384m", "-XX:+AlwaysPreTouch", "-XX:+UseSerialGC"} <= set(cmdline)  # command line only...
    assert os.environ.get("JAVA_TOOL_OPTIONS") == JAVA_TOOL_OPTIONS  # ...not put where other processes see it


@needs_java
def test_invalid_action_and_available_actions(backend, env) -> None:
    env.reset(first_index(backend, "4-1"))
    moved = env.step("open door to kitchen")
    bad = env.step("fly to the moon")
    assert bad.observation == "No known action matches that input."
    assert (bad.reward, bad.score, bad.done) == (moved.reward, moved.score, False)
    actions = env.available_actions()
    assert {"look around", "open OBJ", "move OBJ to OBJ", "OBJ = air"} <= set(actions) and len(actions) < 200


@needs_java
def test_gold_path_reaches_reward_one_then_episode_is_finished(backend, env) -> None:
    idx = first_index(backend, "7-1")
    first = env.reset(idx)
    out = first
    for action in expert.gold_actions(first.info["task_name"], first.info["var_num"]):
        out = env.step(action)
        assert out.reward == normalised_reward(out.score)
        if out.done:  # the task can complete before the gold path's trailing waits
            break
    expert.close_local_simulator()
    assert (out.reward, out.score, out.done, out.success) == (1.0, 100.0, True, True)
    with pytest.raises(EpisodeFinishedError):
        env.step("look around")


@needs_java
def test_failed_task_scores_minus_100_and_reward_zero(backend, env) -> None:
    env.reset(first_index(backend, "7-1"))
    out = env.step("focus on agent")  # focusing on the wrong thing fails a lifespan task
    assert (out.score, out.reward, out.done, out.success) == (-100.0, 0.0, True, False)


@needs_java
def test_step_before_reset_is_refused(env) -> None:
    with pytest.raises(EpisodeFinishedError, match="reset"):
        env.step("look around")
    with pytest.raises(EpisodeFinishedError):
        env.available_actions()


@needs_java
def test_same_index_same_first_observation_across_jvms_and_threads(backend) -> None:
    idx = first_index(backend, "2-3") + 7
    a = backend.new_instance()
    reference = a.reset(idx)
    a.reset(first_index(backend, "6-1"))  # the JVM now carries another world, then goes back to the pool
    a.close()
    envs = [backend.new_instance() for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda e: e.reset(idx), envs))
    for e in envs:
        e.close()
    for r in results:
        assert (r.observation, r.info) == (reference.observation, reference.info)


@needs_java
def test_pool_exhaustion_raises_capacity_error(backend) -> None:
    idx = first_index(backend, "7-2")
    held = [backend.new_instance() for _ in range(2)]
    for e in held:
        e.reset(idx)
    extra = backend.new_instance()
    with pytest.raises(CapacityError, match="max_jvms"):
        extra.reset(idx)
    held[0].close()
    assert extra.reset(idx).observation  # a closed instance's JVM serves the next one
    extra.close()
    held[1].close()


@needs_java
def test_jvms_are_reused_not_started_per_reset(backend) -> None:
    indices = [first_index(backend, t) for t in ("7-1", "7-2", "4-4", "8-1")]
    baseline = None
    for cycle in range(12):
        pair = [backend.new_instance() for _ in range(2)]
        for k, e in enumerate(pair):
            e.reset(indices[(cycle + k) % len(indices)])
            e.step("look around")
        for e in pair:
            e.close()
        if baseline is None:
            baseline = (java_children(), backend.pool.stats()["launched"])
    assert java_children() == baseline[0] and len(baseline[0] & set(backend.pool.pids())) <= 2
    assert backend.pool.stats()["launched"] == baseline[1] <= 2


@needs_java
def test_crashed_jvm_is_discarded_and_replaced(backend) -> None:
    idx = first_index(backend, "7-3")
    e = backend.new_instance()
    e.reset(idx)
    dead = e._jvm.pid
    e._jvm.proc.kill()
    e._jvm.proc.wait()
    discarded = backend.pool.stats()["discarded"]
    with pytest.raises(SimulatorCrashedError, match="reset"):
        e.step("look around")
    with pytest.raises(EpisodeFinishedError):
        e.step("look around")
    assert e.reset(idx).observation and e._jvm.pid != dead
    assert backend.pool.stats()["discarded"] == discarded + 1 and dead not in backend.pool.pids()
    e.close()
    idle = backend.pool.pids()  # JVMs that die while idle are not handed out again
    for pid in idle:
        psutil.Process(pid).kill()
        psutil.Process(pid).wait(timeout=10)
    before = backend.pool.stats()
    f = backend.new_instance()
    f.reset(idx)
    assert f._jvm.pid not in idle and f._jvm.alive()
    after = backend.pool.stats()
    assert (after["launched"], after["discarded"]) == (before["launched"] + 1, before["discarded"] + len(idle))
    f.close()


@needs_java
def test_shutdown_stops_every_jvm() -> None:
    b = Backend(max_jvms=1)
    e = b.new_instance()
    e.reset(first_index(b, "7-1"))
    pid = e._jvm.pid
    b.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(CapacityError, match="shut down"):
        b.new_instance().reset(0)


# ---------------------------------------------------------------- expert through HTTP


def spread_sample(rows: list[dict], n: int) -> list[int]:
    """Round-robin over sub-tasks (each in index order): every subset present, n items in all."""
    groups: dict[str, list[int]] = defaultdict(list)
    for row in rows:
        groups[row["sub_task"]].append(int(row["item_id"].rsplit("_", 1)[1]))
    picked: list[int] = []
    while len(picked) < n and any(groups.values()):
        for label in sorted(groups):
            if groups[label] and len(picked) < n:
                picked.append(groups[label].pop(0))
    return sorted(picked)


@pytest.mark.slow
@needs_java
def test_expert_gold_paths_through_http() -> None:
    from envs.launcher import running_server
    from envs.splits import load_split

    sample = spread_sample(load_split("sciworld", "test"), 64)
    assert len(sample) == 64
    results: dict[int, float] = {}
    lock = threading.Lock()
    with running_server("sciworld", max_jvms=3) as url:

        def play(idx: int) -> None:
            client = Client(url)
            try:
                out = expert.solve(client, idx)
            finally:
                client.close()
            with lock:
                results[idx] = out.reward

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(play, sample))
    solved = sum(r == 1.0 for r in results.values())
    assert solved >= 0.95 * len(sample), {i: r for i, r in results.items() if r < 1.0}
