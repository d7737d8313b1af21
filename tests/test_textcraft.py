"""TextCraft in-process tests: recipe parsing, frozen goals, episode rules, no tree leak, determinism
under threads, the client prompt, and the expert on all 544 goals (in-process and through HTTP)."""

from __future__ import annotations

import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from envs.base import DataIndexError, EpisodeFinishedError
from envs.client import ClientLogic, StepOutput
from envs.splits import item_index, load_split
from envs.textcraft.backend import TEMPLATES, Backend, TextCraftEnv
from envs.textcraft.client import Client, Spec
from envs.textcraft.expert import Planner, parse_observation, solve
from envs.textcraft.recipes import (
    CraftingTree,
    RecipeDataError,
    load_goals,
    load_tree,
    package_recipes_dir,
    read_recipes,
)


@pytest.fixture(scope="module")
def backend() -> Backend:
    return Backend()


def goal_index(backend: Backend, name: str) -> int:
    return next(g.index for g in backend.goals if g.name == name)


class InProcessClient(Spec, ClientLogic):
    """The real client logic (ReAct parsing, action cleaning) over an in-process instance."""

    def __init__(self, env: TextCraftEnv) -> None:
        self.env = env
        self.id = 0

    @staticmethod
    def _payload(result: Any) -> dict[str, Any]:
        return {
            "observation": result.observation,
            "reward": result.reward,
            "score": result.score,
            "done": result.done,
            "success": result.success,
        }

    def reset(self, data_idx: int) -> StepOutput:
        return self._output(self._payload(self.env.reset(data_idx)))

    def step(self, reply: str) -> StepOutput:
        action = self._prepare(reply)
        return action if isinstance(action, StepOutput) else self._output(self._payload(self.env.step(action)))


# --- recipe data, tree and goals -------------------------------------------------------------------


def test_package_data_and_goal_counts() -> None:
    folder = package_recipes_dir()
    assert len(list(folder.glob("*.json"))) == 860
    assert len(read_recipes(folder)) == 635  # shaped + shapeless only
    goals = load_tree().goals()
    assert len(goals) == 544
    assert sorted(Counter(g.depth for g in goals).items()) == [(1, 125), (2, 291), (3, 117), (4, 11)]
    assert [g.depth for g in goals] == sorted(g.depth for g in goals)


def test_frozen_goals_equal_the_tree_goals() -> None:
    frozen = load_goals()
    assert frozen == load_tree().goals()
    assert frozen[0].item == "minecraft:acacia_planks" and frozen[543].depth == 4


def _write(folder: Path, name: str, data: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(data))


def _item(name: str) -> dict:
    return {"item": f"minecraft:{name}"}


def test_parsing_rules(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "a_plank",
        {
            "type": "minecraft:crafting_shapeless",
            "group": "plank",
            "ingredients": [{"tag": "minecraft:log"}],
            "result": {"item": "minecraft:oak_plank", "count": 4},
        },
    )
    _write(
        tmp_path,
        "b_box",
        {
            "type": "minecraft:crafting_shaped",
            "pattern": ["##", "#X"],
            "key": {"#": {"tag": "minecraft:plank"}, "X": [_item("iron"), _item("gold")]},
            "result": {"item": "minecraft:box"},
        },
    )
    _write(
        tmp_path,
        "c_pair",
        {
            "type": "minecraft:crafting_shapeless",
            "result": "minecraft:pair",
            "ingredients": [_item("box"), _item("box"), _item("stone")],
        },
    )
    _write(
        tmp_path,
        "d_unpack",
        {
            "type": "minecraft:crafting_shapeless",
            "ingredients": [_item("iron_block")],
            "result": {"item": "minecraft:iron", "count": 9},
        },
    )
    _write(
        tmp_path,
        "e_cycle",
        {"type": "minecraft:crafting_shapeless", "ingredients": [_item("pair")], "result": {"item": "minecraft:stone"}},
    )
    _write(
        tmp_path, "f_smelt", {"type": "minecraft:smelting", "ingredient": _item("sand"), "result": "minecraft:glass"}
    )
    tree = CraftingTree(read_recipes(tmp_path))
    assert tree.by_output["minecraft:box"][0].inputs == (("#minecraft:plank", 3), ("minecraft:iron", 1))
    assert tree.by_output["minecraft:pair"][0].inputs == (("minecraft:box", 2), ("minecraft:stone", 1))
    assert set(tree.skipped) == {"d_unpack", "e_cycle"}
    assert "minecraft:glass" not in tree.by_output
    assert tree.members["#minecraft:plank"] == {"minecraft:oak_plank"}
    assert tree.matches("#minecraft:plank", "minecraft:oak_plank")
    assert not tree.matches("#minecraft:plank", "minecraft:box")
    assert "#minecraft:log" in tree.base and "minecraft:iron" in tree.base  # tag without members -> base item
    assert [(g.name, g.depth) for g in tree.goals()] == [("oak plank", 1), ("box", 2), ("pair", 3)]
    assert tree.by_output["minecraft:box"][0].command() == "craft 1 box using 3 plank, 1 iron"


def test_backend_refuses_goals_no_longer_craftable(tmp_path: Path) -> None:
    goals = tmp_path / "goals.json"
    goals.write_text(json.dumps([{"index": 0, "item": "minecraft:unobtainium", "name": "unobtainium", "depth": 1}]))
    with pytest.raises(RecipeDataError, match="unobtainium"):
        Backend(goals_path=str(goals))
    with pytest.raises(RecipeDataError, match="does not exist"):
        Backend(goals_path=str(tmp_path / "missing.json"))


def test_index_space_and_sub_tasks(backend: Backend) -> None:
    assert backend.num_items == 544
    labels = [backend.sub_task(i) for i in range(544)]
    assert labels[0] == labels[124] == "depth1" and labels[125] == labels[415] == "depth2"
    assert labels[416] == labels[532] == "depth3" and labels[533] == labels[543] == "depth4"
    for bad in (-1, 544, 10_000):
        with pytest.raises(DataIndexError):
            backend.new_instance().reset(bad)
    test_items = load_split("textcraft", "test")
    assert len(test_items) == 100
    assert all(row["sub_task"] == backend.sub_task(item_index(row["item_id"])) for row in test_items)


# --- episode rules ---------------------------------------------------------------------------------


def test_depth1_episode_replies(backend: Backend) -> None:
    env = backend.new_instance()
    with pytest.raises(EpisodeFinishedError):
        env.step("inventory")
    first = env.reset(0)
    assert first.observation == (
        "Crafting commands:\ncraft 4 acacia planks using 1 acacia logs\n\nGoal: craft acacia planks."
    )
    assert env.available_actions() == [*TEMPLATES, "craft 4 acacia planks using 1 acacia logs"]
    replies = [
        env.step(a)
        for a in (
            "inventory",
            "get 1 acacia planks",
            "get 2 acacia logs",
            "inventory",
            "craft 4 acacia planks using 2 acacia logs",
            "dance",
        )
    ]
    assert [r.observation for r in replies] == [
        "Inventory: You are not carrying anything.",
        "Could not find acacia planks",
        "Got 2 acacia logs",
        "Inventory: [acacia logs] (2)",
        "Could not find a valid recipe for acacia planks using 2 acacia logs",
        "Could not execute dance",
    ]
    assert not any(r.done or r.reward for r in replies)
    done = env.step("craft 4 acacia planks using 1 acacia logs")
    assert (done.observation, done.reward, done.score, done.done, done.success) == (
        "Crafted 4 minecraft:acacia_planks",
        1.0,
        1.0,
        True,
        True,
    )
    assert env.observe() == done.observation
    with pytest.raises(EpisodeFinishedError):
        env.step("inventory")


def test_tags_consumption_and_errors(backend: Backend) -> None:
    env = backend.new_instance()
    env.reset(goal_index(backend, "chest"))
    assert "craft 1 chest using 8 planks" in env.observe()
    assert env.step("get 8 planks").observation == "Could not find planks"  # a tag with craftable members
    assert env.step("get 2 oak logs").observation == "Got 2 oak logs"
    assert env.step("craft 4 oak planks using 1 oak logs").observation == "Crafted 4 minecraft:oak_planks"
    short = env.step("craft 1 chest using 8 oak planks")
    assert short.observation == "Could not find enough items to craft minecraft:chest"
    env.step("craft 4 oak planks using 1 oak logs")
    assert env.step("get oak logs").observation.startswith("Wrong item format")
    assert env.step("craft chest").observation.startswith("Could not extract recipe")
    assert env.step("craft 1 chest using 4 oak planks, 4 planks").observation.startswith("Could not find a valid")
    assert env.step("craft 1 chest using 8 oak planks").success
    assert env.inventory == {"minecraft:chest": 1}


def test_mixed_specific_types_do_not_match_one_tag(backend: Backend) -> None:
    env = backend.new_instance()
    env.reset(goal_index(backend, "chest"))
    for log in ("oak", "birch"):
        env.step(f"get 1 {log} logs")
        env.step(f"craft 4 {log} planks using 1 {log} logs")
    result = env.step("craft 1 chest using 4 oak planks, 4 birch planks")
    assert result.observation.startswith("Could not find a valid recipe") and not result.done


# --- shared tree: no leak, determinism across threads ----------------------------------------------


def _snapshot(tree: CraftingTree) -> dict:
    return {
        "by_output": {k: list(v) for k, v in tree.by_output.items()},
        "uses": {k: list(v) for k, v in tree.uses.items()},
        "members": {k: sorted(v) for k, v in tree.members.items()},
        "recipes": list(tree.recipes),
    }


def test_resets_never_grow_the_shared_tree(backend: Backend) -> None:
    before = _snapshot(backend.tree)
    sizes = {k: len(v) for k, v in before["by_output"].items()}
    env = backend.new_instance()
    first = env.reset(300).observation
    for i in range(3000):
        env.reset((i * 7) % 544)
    for _ in range(998):
        env.reset(300)
    assert env.reset(300).observation == first  # the 1000th reset of index 300 shows the same list
    after = _snapshot(backend.tree)
    assert after == before
    assert {k: len(v) for k, v in after["by_output"].items()} == sizes


def test_same_index_same_observation_across_threads(backend: Backend) -> None:
    indices = [533, *random.Random(1).sample(range(544), 30), 533, *range(400, 430), 533]

    def first_observation(idx: int) -> tuple[int, str]:
        return idx, backend.new_instance().reset(idx).observation

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(first_observation, indices))
    seen = [obs for idx, obs in results if idx == 533]
    assert len(seen) == 3 and len(set(seen)) == 1
    assert seen[0] == backend.new_instance().reset(533).observation
    assert seen[0] != backend.new_instance().reset(532).observation


# --- client and expert -----------------------------------------------------------------------------


def test_client_prompt_and_cleaning() -> None:
    human, gpt = Client.conversation_start
    assert human["from"] == "human" and gpt["from"] == "gpt" and gpt["loss"] is False
    for phrase in ("craft", "using", "get", "inventory", "Thought:", "Action:", "quantity"):
        assert phrase in human["value"]
    assert Spec().parse("Thought: go.\nAction: craft 4 oak_planks using 1 oak logs!") == (
        "craft 4 oakplanks using 1 oak logs"
    )


def test_expert_solves_every_goal_in_process(backend: Backend) -> None:
    for idx in range(backend.num_items):
        client = InProcessClient(backend.new_instance())
        out = solve(client, idx)
        assert out.success and out.reward == 1.0, f"goal {idx} ({backend.goals[idx].name}) not crafted"
        assert out.observation.startswith("Crafted ")


def test_expert_replans_after_a_refused_substitute() -> None:
    text = (
        "Crafting commands:\ncraft 1 painting using 8 stick, 1 wool\ncraft 1 black wool using 1 black dye, 1 "
        "white wool\ncraft 1 white wool using 4 string\ncraft 1 red wool using 1 red dye, 1 white wool\n\n"
        "Goal: craft painting."
    )
    planner = Planner(*parse_observation(text))
    first = planner.plan()
    assert first[0] == ("get 8 stick", "stick") and first[-1][0] == "craft 1 painting using 8 stick, 1 black wool"
    for action, item in first[:-1]:
        reply = f"Got {action[4:]}" if action.startswith("get") else f"Crafted 1 minecraft:{item.replace(' ', '_')}"
        assert planner.learn(action, item, reply)
    assert not planner.learn(first[-1][0], "painting", "Could not find a valid recipe for painting using ...")
    second = planner.plan()
    assert second[-1][0] == "craft 1 painting using 8 stick, 1 red wool"
    assert planner.inventory["black wool"] == 1 and ("get 4 string", "string") in second


def test_expert_solves_every_goal_over_http() -> None:
    from envs.launcher import running_server

    with running_server("textcraft") as url, httpx.Client(base_url=url, timeout=60.0) as http:

        def play(idx: int) -> bool:
            client = Client(url, http=http)
            try:
                return solve(client, idx).success
            finally:
                client.close()

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(play, range(544)))
    assert all(results), [i for i, ok in enumerate(results) if not ok]
