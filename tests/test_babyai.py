"""BabyAI backend in-process (levels, text, action expansion, invalid actions, determinism, truncation,
memory, stdout) and the expert, in-process and through a real HTTP server."""

from __future__ import annotations

import gc
import json
import re
import threading
import tracemalloc
import weakref
from collections.abc import Callable

import gymnasium
import pytest
from minigrid.core.world_object import Goal

from envs.babyai import text
from envs.babyai.backend import LEVELS, SUB_TASKS, BabyAIEnv, Backend
from envs.babyai.client import Client, Spec
from envs.babyai.expert import solve
from envs.base import DataIndexError, EpisodeFinishedError
from envs.client import StepOutput
from envs.launcher import running_server
from envs.splits import item_index, load_split

_SEEN = re.compile(r"There is a (.+?) (?:right in front of you (\d+) steps away|(\d+) steps in front of you and "
                   r"(\d+) steps to your (left|right))\.")


class LocalClient(Spec):
    """The client's parsing over an in-process instance (the expert without HTTP)."""

    def __init__(self, backend: Backend) -> None:
        self.env = backend.new_instance()

    def reset(self, data_idx: int) -> StepOutput:
        r = self.env.reset(data_idx)
        return StepOutput(r.observation, r.reward, r.score, r.done, r.success, r.info)

    def step(self, reply: str) -> StepOutput:
        r = self.env.step(self.parse(reply))
        return StepOutput(r.observation, r.reward, r.score, r.done, r.success, r.info)


@pytest.fixture(scope="module")
def backend() -> Backend:
    return Backend()


def _state(env: BabyAIEnv) -> tuple:
    w = env.minigrid
    return tuple(w.agent_pos), w.agent_dir, w.step_count, w.carrying, tuple(env.available_actions())  # type: ignore[attr-defined]


def _find(backend: Backend, want: Callable[[BabyAIEnv], bool], indices: range = range(400)) -> BabyAIEnv:
    env = backend.new_instance()
    for idx in indices:
        env.reset(idx)
        if want(env):
            return env
    raise AssertionError("no episode in range satisfies the condition")


def _with_action(prefix: str) -> Callable[[BabyAIEnv], bool]:
    return lambda env: any(a.startswith(prefix) for a in env.available_actions())


def test_levels_and_sub_tasks(backend: Backend) -> None:
    assert len(LEVELS) == len(set(LEVELS)) == 40
    assert LEVELS[0] == "BabyAI-GoToRedBallGrey-v0" and LEVELS[-1] == "BabyAI-BossLevelNoUnlock-v0"
    assert all(level in gymnasium.registry for level in LEVELS)
    labels = [backend.sub_task(i) for i in range(40)]
    assert set(labels) == set(SUB_TASKS)
    assert [labels.count(s) for s in ("GoTo", "Open", "Pickup", "PutNext", "Unlock", "Other")] == [11, 5, 5, 2, 6, 11]
    assert backend.sub_task(40 * 7 + 25) == "Unlock" and backend.num_items is None
    with pytest.raises(DataIndexError):
        backend.new_instance().reset(-1)


def test_the_one_pass_view_is_minigrids_own_cell_for_cell() -> None:
    """envs.babyai.view gives the grid (the very objects; a wall outside the world) and visibility mask that
    minigrid's gen_obs_grid gives, on random walks through every level, carrying included; make_env installs it."""
    import random

    from minigrid.minigrid_env import MiniGridEnv

    from envs.babyai import view
    from envs.babyai.backend import _FACTORIES, make_env

    rng, states, carried = random.Random(5), 0, 0
    for level in _FACTORIES:
        env = make_env(level)
        assert env.gen_obs_grid.__func__ is view.gen_obs_grid
        env.reset(seed=rng.randrange(10**6))
        for _ in range(25):
            _, _, terminated, truncated, _ = env.step(rng.randrange(6))
            if terminated or truncated:
                env.reset(seed=rng.randrange(10**6))
            theirs, their_mask = MiniGridEnv.gen_obs_grid(env)
            ours, our_mask = env.gen_obs_grid()
            assert (our_mask == their_mask).all() and (ours.encode(our_mask) == theirs.encode(their_mask)).all()
            assert all(a is b or (a.type == b.type == "wall" and a is not None) for a, b in
                       zip(ours.grid, theirs.grid, strict=True)), (level, env.agent_pos, env.agent_dir)
            states, carried = states + 1, carried + (env.carrying is not None)
    assert states == 25 * len(_FACTORIES) and carried > 0


def test_reset_and_step_text(backend: Backend) -> None:
    env = backend.new_instance()
    first = env.reset(0)
    goal, *rest = first.observation.split("\n")
    assert goal == "Your goal: go to the red ball" and first.info["level"] == LEVELS[0]
    assert rest[-1].startswith("Available actions: ") and json.loads(rest[-1][19:]) == env.available_actions()
    assert "You are not carrying anything." in rest[0] and "There is a red ball 1 " in rest[0]
    assert (first.reward, first.score, first.done, first.success) == (0.0, 0.0, False, False)
    after = env.step("turn left")
    assert not after.observation.startswith("Your goal") and after.observation == env.observe()
    assert after.observation.split("\n")[-1] == "Available actions: " + json.dumps(env.available_actions())


@pytest.mark.parametrize("data_idx", [0, 5, 13, 38, 77, 121, 159])
def test_description_matches_the_grid(backend: Backend, data_idx: int) -> None:
    """Every described object is where its egocentric offsets say, and has the named kind and colour."""
    env = backend.new_instance()
    env.reset(data_idx)
    w = env.minigrid
    (px, py), (fx, fy) = w.agent_pos, w.dir_vec  # type: ignore[attr-defined]
    seen = _SEEN.findall(env.observe())
    assert seen, "expected visible objects in these episodes"
    for label, ahead, front, right, side in seen:
        f, r = (int(ahead), 0) if ahead else (int(front), int(right) * (1 if side == "right" else -1))
        cell = w.grid.get(px + f * fx - r * fy, py + f * fy + r * fx)  # type: ignore[attr-defined]
        name = label.rsplit(" ", 1)[0]
        assert cell is not None and name.startswith(cell.color) and name.endswith(cell.type), (label, cell)


def test_turns_and_blocked_forward(backend: Backend) -> None:
    env = _find(backend, lambda e: "move forward" not in e.available_actions())
    w = env.minigrid
    before = _state(env)
    out = env.step("move forward")
    assert "you can't move forward" in out.observation and _state(env) == before and not out.done
    env.step("Turn   LEFT")  # normalised like the client does
    assert w.agent_dir == (before[1] - 1) % 4 and w.step_count == before[2] + 1  # type: ignore[attr-defined]


def test_go_to_and_pickup_and_drop(backend: Backend) -> None:
    env = _find(backend, _with_action("pickup "))
    w = env.minigrid
    label = next(a for a in env.available_actions() if a.startswith("pickup "))[len("pickup "):]
    target = env._scene.targets[label]  # type: ignore[union-attr]
    start_steps = w.step_count  # type: ignore[attr-defined]
    env.step(f"go to {label}")
    assert tuple(w.front_pos) == (target.x, target.y) and w.step_count > start_steps  # type: ignore[attr-defined]
    obj = w.grid.get(target.x, target.y)  # type: ignore[attr-defined]
    out = env.step(f"pickup {label}")
    assert w.carrying is obj and f"You are carrying a {obj.color} {obj.type}." in out.observation  # type: ignore[attr-defined]
    assert not any(a.startswith("pickup ") for a in env.available_actions())
    if "drop" in env.available_actions():
        env.step("drop")
        assert w.carrying is None  # type: ignore[attr-defined]


def _closed_door(env: BabyAIEnv) -> str | None:
    return next((a[len("toggle and go through "):] for a in env.available_actions()
                 if a.startswith("toggle and go through") and " closed door " in a), None)


def test_go_through_open_door(backend: Backend) -> None:
    env = _find(backend, lambda e: _closed_door(e) is not None)
    w = env.minigrid
    label = _closed_door(env)
    door = env._scene.targets[label]  # type: ignore[union-attr,index]
    env.step(f"go to {label}")
    assert "toggle" in env.available_actions()
    env.step("toggle")
    opened = next(a for a in env.available_actions() if a.startswith("go through ")
                  and env._scene.targets[a[len("go through "):]].x == door.x  # type: ignore[union-attr]
                  and env._scene.targets[a[len("go through "):]].y == door.y)  # type: ignore[union-attr]
    assert " open door " in opened
    env.step(opened)
    fx, fy = w.dir_vec  # type: ignore[attr-defined]
    assert tuple(w.agent_pos) == (door.x + fx, door.y + fy) and w.grid.get(door.x, door.y).is_open  # type: ignore[attr-defined]


def test_toggle_and_go_through_closed_door(backend: Backend) -> None:
    env = _find(backend, lambda e: _closed_door(e) is not None)
    w = env.minigrid
    label = _closed_door(env)
    target = env._scene.targets[label]  # type: ignore[union-attr,index]
    out = env.step(f"toggle and go through {label}")
    door = w.grid.get(target.x, target.y)  # type: ignore[attr-defined]
    assert door.is_open and "no path" not in out.observation
    assert tuple(w.agent_pos) != (target.x, target.y) or out.done  # walked through, not left in the doorway


def test_invalid_actions_change_nothing(backend: Backend) -> None:
    env = backend.new_instance()
    env.reset(3)
    before = (_state(env), env.available_actions())
    cases = {
        "fly away": text.UNKNOWN_ACTION,
        "pickup purple unicorn 3": "There is no purple unicorn 3 in sight",
        "drop": "you are not carrying anything",
        "go through red ball 1": "There is no red ball 1 in sight",
    }
    for action, message in cases.items():
        out = env.step(action)
        assert message in out.observation and (out.reward, out.done) == (0.0, False), action
        assert out.observation.endswith("Available actions: " + json.dumps(before[1]))
        assert _state(env) == before[0]
    assert env.step("check available actions").observation.endswith(json.dumps(before[1]))


def test_go_to_goal(backend: Backend) -> None:
    """No level of the 40 has a goal square: put one in sight and walk onto it."""
    env = backend.new_instance()
    env.reset(2)
    w = env.minigrid
    x, y = next((int(w.agent_pos[0] + f * w.dir_vec[0]), int(w.agent_pos[1] + f * w.dir_vec[1]))  # type: ignore[attr-defined]
                for f in (3, 2, 1) if w.grid.get(*(w.agent_pos + f * w.dir_vec)) is None)  # type: ignore[attr-defined]
    w.grid.set(x, y, Goal())  # type: ignore[attr-defined]
    view = text.scene(w, w.gen_obs()["image"])  # type: ignore[attr-defined]
    assert "go to goal" in view.actions and view.goal == (x, y)
    plan = text.expand(w, "go to goal", view)
    assert isinstance(plan, list) and plan[-1] == text.FORWARD
    for primitive in plan:
        _, reward, terminated, _, _ = w.step(primitive)  # type: ignore[attr-defined]
    assert terminated and reward > 0 and tuple(w.agent_pos) == (x, y)  # type: ignore[attr-defined]


def test_truncation_and_finished_episode(backend: Backend) -> None:
    env = backend.new_instance()
    with pytest.raises(EpisodeFinishedError):
        env.step("turn left")
    env.reset(0)
    limit = env.minigrid.max_steps  # type: ignore[attr-defined]
    outs = [env.step("turn left") for _ in range(limit)]
    assert not any(o.done for o in outs[:-1])
    assert outs[-1].done and not outs[-1].success and outs[-1].reward == 0.0 and "step limit" in outs[-1].observation
    with pytest.raises(EpisodeFinishedError):
        env.step("turn left")


def test_success_reward(backend: Backend) -> None:
    client = LocalClient(backend)
    out = solve(client, 0)  # type: ignore[arg-type]
    w = client.env.minigrid
    assert out.done and out.success and "The task is completed." in out.observation
    assert out.reward == out.score == pytest.approx(1 - 0.9 * w.step_count / w.max_steps)  # type: ignore[attr-defined]


def test_same_index_same_episode_across_threads(backend: Backend) -> None:
    indices = [0, 7, 22, 25, 38, 39, 100, 123]
    serial = {i: backend.new_instance().reset(i).observation for i in indices}
    barrier, results, errors = threading.Barrier(8), {}, []

    def worker(k: int) -> None:
        try:
            env = backend.new_instance()
            env.reset((k * 13) % 40)  # a different level first, so reuse of the env is exercised too
            barrier.wait()
            for i in indices[k:] + indices[:k]:
                results[(k, i)] = env.reset(i).observation
                env.step("move forward")
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 64
    assert all(obs == serial[i] for (_, i), obs in results.items())


def test_close_frees_the_minigrid_env(backend: Backend) -> None:
    env = backend.new_instance()
    refs = []
    for idx in range(0, 200, 7):
        env.reset(idx)
        refs.append(weakref.ref(env.minigrid))
    env.close()
    gc.collect()
    assert all(ref() is None for ref in refs) and env.minigrid is None


def test_level_generation_prints_nothing(backend: Backend, capfd: pytest.CaptureFixture[str],
                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="envs.babyai.backend")
    env = backend.new_instance()
    for idx in (6, 46, 86, 38, 78):  # GoToImpUnlock and BossLevel reject samples while generating
        env.reset(idx)
    assert capfd.readouterr().out == ""
    assert any("Sampling rejected" in r.getMessage() for r in caplog.records)


def test_client_cleaning_and_prompt() -> None:
    logic = Spec()
    assert logic.parse("Thought: the key.\nAction: Pickup Grey-Key 1!") == "pickup greykey 1"
    assert logic.parse("Thought: ok\nAction: Go to  red ball 1.") == "go to red ball 1"
    human, gpt = Spec.conversation_start
    assert human["from"] == "human" and gpt["from"] == "gpt" and "Action:" in human["value"]


@pytest.mark.parametrize("data_idx", [1, 22, 25, 31, 38, 54, 107, 135])
def test_expert_in_process(backend: Backend, data_idx: int) -> None:
    """Including PutNextS7N4Carrying (22) and KeyInBox (25), which the bare bot cannot solve."""
    out = solve(LocalClient(backend), data_idx)  # type: ignore[arg-type]
    assert out.done and out.success and out.reward > 0


@pytest.mark.slow
def test_expert_through_http_on_test_split() -> None:
    items = load_split("babyai", "test")
    assert len(items) == 90
    wins = []
    with running_server("babyai") as url:
        for item in items:
            client = Client(url)
            try:
                wins.append(solve(client, item_index(item["item_id"])).success)
            finally:
                client.close()
    # 4 of the 90 are OpenDoorsOrderN4Debug sequence missions, unsolvable in minigrid 3.2 (see expert.py).
    assert sum(wins) / len(wins) >= 0.95, f"{sum(wins)}/{len(wins)}"


def test_reset_close_cycles_do_not_grow_memory(backend: Backend) -> None:
    def cycles(start: int, n: int) -> None:
        for idx in range(start, start + n):
            env = backend.new_instance()
            if not env.reset(idx).done:
                env.step("move forward")
            env.close()

    cycles(0, 120)  # warm-up: imports, interned strings, numpy caches
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cycles(120, 400)
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert growth < 64 * 1024, f"{growth} bytes kept after 400 reset/close cycles"


def test_the_sighted_expert_plays_goto_in_high_level_actions_and_sft_keeps_only_its_successes() -> None:
    from envs.corpus import played_episode
    from envs.local import local_client
    from envs.registry import expert
    from training.warmstart.sft import expert_episodes

    goto = [r["item_id"] for r in load_split("babyai", "warm") if r["sub_task"] == "GoTo"][:30]
    client = local_client("babyai")
    try:
        played = {i: played_episode("babyai", client, item_index(i), "sighted") for i in goto}
        solved = [i for i, (_, ok) in played.items() if ok]
        assert 5 <= len(solved) < len(goto)  # a goal never in sight in three left turns is a failure
        texts, _ = played[solved[0]]
        replies = texts[1::2]
        assert all(r.endswith("Action: turn left") for r in replies[:-1]) and "Action: go to " in replies[-1]
        assert len(replies) <= 4
        other = next(r["item_id"] for r in load_split("babyai", "warm") if r["sub_task"] == "Open")
        with pytest.raises(ValueError, match="GoTo missions only"):
            played_episode("babyai", client, item_index(other), "sighted")
    finally:
        client.close()
        client.backend.shutdown()
    with pytest.raises(ValueError, match="babyai has no expert 'psychic': it offers default, sighted"):
        expert("babyai", "psychic")
    # SFT's expert episodes: the first `count` the expert solves, in order, its failures left out
    episodes = expert_episodes("babyai", goto, count=3, expert="sighted")
    assert list(episodes) == solved[:3]
