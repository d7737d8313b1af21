"""TextCraft expert: a planner that reads only what the agent reads and crafts the goal through HTTP.

From the first observation it parses the recipe lines (``craft <n> <item> using <n> <item>, ...``) and
the goal, chooses for every needed item the cheapest way to obtain it (a recipe line, or ``get`` for an
item no line produces), computes how many of each base item and how many crafts are needed, then
fetches all base items and crafts the intermediates in dependency order. A generic ingredient that no
line produces and that the planner must not fetch (``planks``, ``wool``) is replaced by a produced item
whose name ends with it (``oak planks``), as the prompt allows. When the environment refuses an action
(a fetch of a craftable item, a wrong specific type), the planner records that and re-plans from its
inventory, so it never needs hidden knowledge of the recipe data.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from envs.client import BaseEnvClient, StepOutput
from envs.textcraft.recipes import reaches

_LINE = re.compile(r"craft (\d+) (.+?) using (.+)")
_PART = re.compile(r"(\d+) (.+)")
_GOAL = re.compile(r"Goal: craft (.+?)\.?\s*$", re.MULTILINE)
_CRAFTED = re.compile(r"Crafted (\d+) ")


@dataclass(frozen=True)
class Line:
    """One shown recipe line."""

    count: int
    output: str
    inputs: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Way:
    """How to obtain one item: fetch it, or craft it by ``line`` with ``inputs`` made concrete."""

    line: Line | None
    inputs: tuple[tuple[str, int], ...] = ()
    substituted: tuple[tuple[str, str], ...] = ()  # (generic ingredient, specific item) used here
    cost: int = 1


def parse_observation(text: str) -> tuple[dict[str, list[Line]], str]:
    """The recipe lines of a reset observation (output name -> lines) and the goal's name."""
    goal = _GOAL.search(text)
    if goal is None:
        raise ValueError(f"no 'Goal: craft ...' in the observation: {text[-200:]!r}")
    recipes: dict[str, list[Line]] = {}
    for raw in text.splitlines():
        match = _LINE.fullmatch(raw.strip())
        if match:
            parts = [_PART.fullmatch(p.strip()) for p in match[3].split(",")]
            inputs = tuple((p[2], int(p[1])) for p in parts if p)
            recipes.setdefault(match[2], []).append(Line(int(match[1]), match[2], inputs))
    return recipes, goal[1]


@dataclass
class Planner:
    """Chooses ways to obtain items and turns them into a list of actions; learns from refusals."""

    recipes: dict[str, list[Line]]
    goal: str
    inventory: dict[str, int] = field(default_factory=dict)
    not_gettable: set[str] = field(default_factory=set)
    bad_lines: set[Line] = field(default_factory=set)
    bad_substitutes: set[tuple[str, str]] = field(default_factory=set)
    _memo: dict[str, Way | None] = field(default_factory=dict)
    _cycles: int = 0  # cycle cut-offs so far: a result that met none does not depend on the path

    def way(self, name: str, visiting: frozenset[str] = frozenset()) -> Way | None:
        """The cheapest way to obtain ``name``, or None (a cycle, a generic ingredient, or nothing works)."""
        if name in self._memo:
            return self._memo[name]
        if name in visiting:
            self._cycles += 1
            return None
        cycles = self._cycles
        result = self._find_way(name, visiting | {name})
        if self._cycles == cycles:
            self._memo[name] = result
        return result

    def _find_way(self, name: str, visiting: frozenset[str]) -> Way | None:
        if name in self.recipes:
            options = [w for line in self.recipes[name] if (w := self._craft_way(line, visiting))]
            return min(options, key=lambda w: w.cost, default=None)
        # No line makes it: a base item to fetch, unless it is a generic ingredient that the lines
        # make specific types of; _craft_way then substitutes one of those.
        if name in self.not_gettable or self._substitutes(name, visiting):
            return None
        return Way(None)

    def _substitutes(self, generic: str, visiting: frozenset[str]) -> list[tuple[str, Way]]:
        """Produced items whose name ends with ``generic``, best first (those other candidates build on last).

        An item whose lines need ``generic`` itself (``white stained glass`` for ``glass``) is no substitute.
        """
        names = [
            n
            for n in self.recipes
            if n.endswith(" " + generic) and (generic, n) not in self.bad_substitutes and not self._needs(n, generic)
        ]
        used_by_others = {i for n in names for line in self.recipes[n] for i, _ in line.inputs}
        found = [(n, w) for n in names if (w := self.way(n, visiting))]
        return sorted(found, key=lambda nw: (nw[0] in used_by_others, nw[1].cost, nw[0]))

    def _needs(self, name: str, target: str) -> bool:
        """Whether some line that makes ``name`` (directly or through its inputs' lines) uses ``target``."""
        deps = {node: [i for line in lines for i, _ in line.inputs] for node, lines in self.recipes.items()}
        return reaches(deps, [name], target)

    def _craft_way(self, line: Line, visiting: frozenset[str]) -> Way | None:
        if line in self.bad_lines:
            return None
        inputs, substituted, cost = [], [], 1
        for name, n in line.inputs:
            way = self.way(name, visiting)
            if way is None:
                options = self._substitutes(name, visiting) if name not in self.recipes else []
                if not options:
                    return None
                substitute, way = options[0]
                substituted.append((name, substitute))
                name = substitute
            inputs.append((name, n))
            cost += way.cost
        return Way(line, tuple(inputs), tuple(substituted), cost)

    def plan(self) -> list[tuple[str, str]]:
        """(action, expected item) pairs: all fetches first, then crafts in dependency order."""
        order: list[str] = []
        ways: dict[str, Way] = {}

        def visit(name: str) -> None:
            if name in ways:
                return
            way = self.way(name)
            if way is None:
                raise RuntimeError(f"no way to obtain {name!r} from the shown recipes")
            ways[name] = way
            for item, _ in way.inputs:
                visit(item)
            order.append(name)  # post-order: inputs before the items made from them

        visit(self.goal)
        need = {self.goal: 1}
        runs: dict[str, int] = {}
        for name in reversed(order):  # consumers before producers, so each need is complete
            way = ways[name]
            held = 0 if name == self.goal else self.inventory.get(name, 0)
            missing = max(0, need.get(name, 0) - held)
            runs[name] = math.ceil(missing / way.line.count) if way.line else missing
            for item, n in way.inputs:
                need[item] = need.get(item, 0) + runs[name] * n
        gets = [(f"get {runs[n]} {n}", n) for n in order if ways[n].line is None and runs[n]]
        crafts = [(craft_command(ways[n]), n) for n in order if ways[n].line for _ in range(runs[n])]
        return gets + crafts

    def learn(self, action: str, item: str, observation: str) -> bool:
        """Update the inventory from a reply; return False (and remember why) when the action failed."""
        if observation.startswith("Got "):
            count = int(action.split()[1])
            self.inventory[item] = self.inventory.get(item, 0) + count
            return True
        crafted = _CRAFTED.match(observation)
        if crafted:
            line = _LINE.fullmatch(action)
            for part in (line[3] if line else "").split(","):
                match = _PART.fullmatch(part.strip())
                if match:
                    self.inventory[match[2]] = self.inventory.get(match[2], 0) - int(match[1])
            self.inventory[item] = self.inventory.get(item, 0) + int(crafted[1])
            return True
        if action.startswith("get "):
            self.not_gettable.add(item)
        else:
            way = self.way(item)
            if way and way.substituted:
                self.bad_substitutes.update(way.substituted)
            elif way and way.line:
                self.bad_lines.add(way.line)
        self._memo.clear()  # a refusal changes which ways are open
        return False


def craft_command(way: Way) -> str:
    """The craft action of a way, with specific items in place of generic ingredients."""
    assert way.line is not None
    used = ", ".join(f"{n} {name}" for name, n in way.inputs)
    return f"craft {way.line.count} {way.line.output} using {used}"


def _reply(action: str, item: str) -> str:
    verb = "fetch" if action.startswith("get ") else "craft"
    return f"Thought: I need {item}, so I will {verb} it next.\nAction: {action}"


def solve(client: BaseEnvClient, data_idx: int, max_turns: int = 200) -> StepOutput:
    """Reset ``data_idx`` through ``client`` and craft its goal; returns the last StepOutput."""
    out = client.reset(data_idx)
    recipes, goal = parse_observation(out.observation)
    planner = Planner(recipes, goal)
    turns = 0
    while not out.done and turns < max_turns:
        try:
            actions = planner.plan()
        except RuntimeError:
            break  # every way was refused: give up, the episode scores 0
        for action, item in actions:
            out = client.step(_reply(action, item))
            turns += 1
            if out.done or turns >= max_turns or not planner.learn(action, item, out.observation):
                break
    return out
