"""TextCraft server backend: craft a Minecraft item from a shown list of recipes.

One :class:`Backend` per server process loads the crafting tree (``envs.textcraft.recipes``) and the
frozen goal list once; every instance reads both and never writes them, so instances in many threads
share them safely and resets cannot grow them (the reference's recipe-tree memory leak).

Episode: ``reset(data_idx)`` shows ``"Crafting commands:\\n<recipe lines>\\n\\nGoal: craft <goal>."`` —
the goal's full recipe tree plus up to 10 distractors, shuffled by the instance's own
``random.Random(data_idx)``, so one index always shows the same text whatever the threads do. Actions:
``get <n> <item>`` (base items only, unlimited), ``craft <n> <item> using <n> <item>, ...`` (the
ingredients must match one recipe of the item exactly, tags through their members; they are consumed)
and ``inventory``. Crafting the goal gives reward 1, score 1, success and done; nothing else scores.

Departure from AgentGym: the reference takes ``goals[data_idx % 544]``; here ``data_idx`` outside
``0..543`` raises :class:`envs.base.DataIndexError` (HTTP 422), so a wrong index is never silently
another task.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from envs import base
from envs.textcraft.recipes import (
    GOALS_PATH,
    CraftingTree,
    Goal,
    Recipe,
    check_goals,
    display_name,
    load_goals,
    load_tree,
    node_id,
)

TEMPLATES = ("craft <n> <item> using <n> <item>, <n> <item>, ...", "get <n> <item>", "inventory")
MAX_DISTRACTORS = 10

_CRAFT = re.compile(r"craft\s+(?:\d+\s+)?(?P<target>.+?)\s+using\s+(?P<inputs>.+)")
_COUNTED = re.compile(r"(?P<count>\d{1,9})\s+(?P<name>\S.*)")  # a count of at most 9 digits (no huge ints)
NOT_STARTED = "The episode has not started: reset it with a data_idx first."


class Backend(base.Backend):
    """Shared, read-only crafting tree and goal list for all TextCraft instances of one server."""

    name = "textcraft"
    fast_steps = True  # microseconds a step: cheaper on the event loop than a thread hop
    reset_on_create = True  # AgentGym's TextCraft /create answers with a reset episode (task 0 here)
    create_options = ("commands", "goal")  # AgentGym's /create {commands, goal}: a task of the client's own
    views = ("commands", "goal", "detail")

    def __init__(self, recipes_dir: str | None = None, goals_path: str | None = None, variant: int = 0) -> None:
        """``variant`` > 0 shows every goal among other recipe lines (its distractors and their order drawn with a
        generator of that variant's own): the same goals seen again, for SFT data; 0 is the environment's text."""
        self.variant = variant
        self.tree: CraftingTree = load_tree(Path(recipes_dir) if recipes_dir else None)
        self.goals: tuple[Goal, ...] = tuple(load_goals(Path(goals_path) if goals_path else GOALS_PATH))
        check_goals(self.tree, list(self.goals))  # once, at start: fail loudly if the data drifted

    @property
    def num_items(self) -> int:
        return len(self.goals)

    def new_instance(self) -> TextCraftEnv:
        return TextCraftEnv(self)

    def sub_task(self, data_idx: int) -> str:
        """``depth1`` .. ``depth4``: the goal's crafting depth."""
        self.check_index(data_idx)
        return f"depth{self.goals[data_idx].depth}"

    def goal(self, data_idx: int) -> Goal:
        """The frozen goal of ``data_idx`` (raises DataIndexError when out of range)."""
        self.check_index(data_idx)
        return self.goals[data_idx]

    def custom_goal(self, goal: str) -> Goal:
        """The goal a client names (``dark oak sign``, ``craft dark oak sign.``, ``minecraft:dark_oak_sign``):
        a craftable item of the tree, or TaskOptionError naming it."""
        text = " ".join(goal.lower().split()).removeprefix("craft ").rstrip(".").strip()
        node = self.tree.names.get(display_name(text))
        if node is None or node not in self.tree.by_output:
            raise base.TaskOptionError(f"goal {goal[:200]!r} is not a craftable item of this server's recipes "
                                       "(name it as the observation does, e.g. 'dark oak sign')")
        return Goal(index=-1, item=node, name=display_name(node), depth=self.tree.depth[node])

    def episode_recipes(self, data_idx: int) -> list[str]:
        """The recipe lines shown for ``data_idx``: recipe tree + distractors, shuffled, duplicates dropped."""
        goal = self.goal(data_idx)
        # the instance's own RNG: same index, same text, in any thread
        rng = random.Random(data_idx) if not self.variant else random.Random(f"{data_idx}/{self.variant}")
        true = self.tree.recipe_tree(goal.item)
        shown: list[Recipe] = true + self.tree.distractors(true, rng, MAX_DISTRACTORS)
        rng.shuffle(shown)
        return list(dict.fromkeys(r.command() for r in shown))  # two files can render the same line


class TextCraftEnv(base.Environment):
    """One TextCraft episode: an inventory, a goal and the recipe lines shown for it."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.tree = backend.tree
        self.goal: Goal | None = None
        self.commands: list[str] = []
        self.inventory: dict[str, int] = {}
        self.observation = NOT_STARTED
        self.done = True
        self.success = False

    def reset(self, data_idx: int) -> base.StepResult:
        goal = self.backend.goal(data_idx)
        self.goal = goal
        self.commands = self.backend.episode_recipes(data_idx)
        self.inventory = {}
        self.done = False
        self.success = False
        self.observation = "Crafting commands:\n" + "\n".join(self.commands) + f"\n\nGoal: craft {goal.name}."
        return base.StepResult(self.observation)

    def reset_custom(self, commands: str = "", goal: str = "", **other: str) -> base.StepResult:
        """AgentGym's ``/create {commands, goal}``: the client's recipe lines are shown as given (one per line) and
        its goal is checked against the tree; crafting follows this server's recipes, as in the reference."""
        if other:
            raise base.TaskOptionError(f"TextCraft takes commands and goal, not {', '.join(other)}")
        self.goal = self.backend.custom_goal(goal)
        self.commands = [line.strip() for line in commands.splitlines() if line.strip()]
        self.inventory = {}
        self.done, self.success = False, False
        self.observation = "Crafting commands:\n" + "\n".join(self.commands) + f"\n\nGoal: craft {self.goal.name}."
        return base.StepResult(self.observation)

    def view(self, name: str) -> object:
        """``commands``: the recipe lines shown; ``goal``: the goal's name; ``detail``: goal, depth, inventory and
        the episode's state (what AgentGym's broken /commands, /goal and cached /detail were meant to give)."""
        assert self.goal is not None
        if name == "commands":
            return "\n".join(self.commands)
        if name == "goal":
            return self.goal.name
        if name == "detail":
            return {"goal": self.goal.name, "depth": self.goal.depth, "data_idx": self.goal.index,
                    "inventory": {display_name(k): v for k, v in self.inventory.items()}, "done": self.done,
                    "success": self.success}
        raise KeyError(name)

    def step(self, action: str) -> base.StepResult:
        if self.done or self.goal is None:
            raise base.EpisodeFinishedError(
                "this TextCraft episode is finished; reset it first" if self.goal else NOT_STARTED
            )
        text = " ".join(action.lower().split())
        if text == "inventory":
            self.observation = self._inventory()
        elif text.startswith("get "):
            self.observation = self._get(text[4:])
        elif text.startswith("craft "):
            self.observation = self._craft(text)
        else:
            self.observation = f"Could not execute {action}"
        reward = 1.0 if self.success else 0.0
        return base.StepResult(self.observation, reward=reward, score=reward, done=self.done, success=self.success)

    def observe(self) -> str:
        return self.observation

    def available_actions(self) -> list[str]:
        return [*TEMPLATES, *self.commands]

    def close(self) -> None:
        self.goal = None
        self.commands = []
        self.inventory = {}
        self.done = True

    def _inventory(self) -> str:
        held = " ".join(f"[{display_name(node)}] ({n})" for node, n in self.inventory.items() if n > 0)
        return f"Inventory: {held}" if held else "Inventory: You are not carrying anything."

    def _get(self, rest: str) -> str:
        match = _COUNTED.fullmatch(rest)
        if not match or int(match["count"]) < 1:
            return f"Wrong item format: {rest}. Write 'get <n> <item>' with a count of at least 1."
        count, name = int(match["count"]), match["name"]
        node = self.tree.names.get(name)
        if node is None or node not in self.tree.base:
            return f"Could not find {name}"  # unknown, or craftable: only base items can be fetched
        self.inventory[node] = self.inventory.get(node, 0) + count
        return f"Got {count} {name}"

    def _parse_ingredients(self, text: str) -> dict[str, int] | str:
        """Ingredient node -> count, or the message explaining what is wrong."""
        given: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",")):
            match = _COUNTED.fullmatch(part)
            if not match or int(match["count"]) < 1:
                return f"Wrong item format: {part}. Write each ingredient as '<n> <item>', separated by commas."
            node = self.tree.names.get(match["name"])
            if node is None:
                return f"Could not find {match['name']}"
            given[node] = given.get(node, 0) + int(match["count"])
        return given

    def _matching_recipe(self, target: str, given: dict[str, int]) -> Recipe | None:
        for recipe in self.tree.by_output.get(target, ()):
            if len(recipe.inputs) == len(given) and self._assign(list(recipe.inputs), dict(given)):
                return recipe
        return None

    def _assign(self, wanted: list[tuple[str, int]], given: dict[str, int]) -> bool:
        """Whether the given ingredients pair off one-to-one with the wanted ones, counts equal."""
        if not wanted:
            return not given
        (node, count), rest = wanted[0], wanted[1:]
        for item, n in given.items():
            if n == count and self.tree.matches(node, item):
                remaining = {k: v for k, v in given.items() if k != item}
                if self._assign(rest, remaining):
                    return True
        return False

    def _craft(self, text: str) -> str:
        match = _CRAFT.fullmatch(text)
        if not match:
            return f"Could not extract recipe from '{text}'. Write: craft <n> <item> using <n> <item>, <n> <item>"
        given = self._parse_ingredients(match["inputs"])
        if isinstance(given, str):
            return given
        target = self.tree.names.get(match["target"])
        recipe = self._matching_recipe(target, given) if target else None
        if recipe is None:
            return f"Could not find a valid recipe for {match['target']} using {match['inputs']}"
        if any(self.inventory.get(node, 0) < n for node, n in given.items()):
            return f"Could not find enough items to craft {recipe.output}"
        for node, n in given.items():
            self.inventory[node] -= n
            if not self.inventory[node]:
                del self.inventory[node]
        self.inventory[recipe.output] = self.inventory.get(recipe.output, 0) + recipe.count
        if self.goal is not None and recipe.output == self.goal.item:
            self.done = self.success = True
        return f"Crafted {recipe.count} minecraft:{node_id(recipe.output)}"
