"""BabyAI expert: minigrid's BabyAIBot, played through the client one primitive action per turn.

The bot needs the full minigrid state, so the expert keeps a local shadow env of the same level and
seed (level generation is deterministic). Each bot primitive is translated into the high-level text
action with the same effect (turn left/right, move forward, toggle, drop, ``pickup <label>`` of the
object in front, numbered as in the current observation) and sent with ``client.step`` as a ReAct
reply; the shadow is stepped with the primitive itself and its observation text must equal the
server's, so any drift is an error, not a silent wrong trajectory.

Around the bot's known gaps:

* ``done`` (the bot thinks the mission is met but minigrid has not ended it, e.g. "go to X" while
  already facing X): sent as ``go to <label in front>``, which the server expands to minigrid's no-op
  ``done`` so that minigrid checks the mission; with nothing in front the expert stops.
* a key hidden in a box (KeyInBox) is invisible to the bot's planner, which asserts: the expert first
  walks to that box (BFS on the shadow grid) and opens it; a box the bot opens itself makes it raise,
  and a fresh bot is made for the new state;
* an object in hand at the start (PutNext...Carrying) breaks the bot's plan: it is put down first;
* planner dead ends (a key behind another locked door in UnlockToUnlock and GoToImpUnlock: a replan
  loop that never returns, cut off by a bounded plan stack, or an assertion): the expert stops there.

:func:`solve_sighted` is a second, much simpler expert for GoTo missions, in the environment's own high-level
actions: it turns left until the goal object is in sight, then sends ``go to <object>``. Its episodes are short
and regular, so a small policy learns them from a few hundred (the main job's warm start, ``expert: sighted``).

BabyAI-OpenDoorsOrderN4Debug-v0 is unsolvable whenever its mission is a sequence ("open A, then open
B"): minigrid 3.2's strict verifier re-checks the action that opened A against B and fails it.
"""

from __future__ import annotations

import json
import re

from minigrid.utils.baby_ai_bot import BabyAIBot, DisappearedBoxError

from envs.babyai import text
from envs.babyai.backend import ending_of, level_of, make_env
from envs.client import BaseEnvClient, StepOutput

MAX_STACK = 100  # the bot's real plans are a few subgoals deep
MAX_REPLAN_LOOKUPS = 20_000  # stack reads within one replan; a stuck replan loop reads it forever
_WORDS = {text.LEFT: "turn left", text.RIGHT: "turn right", text.FORWARD: "move forward", text.TOGGLE: "toggle",
          text.DROP: "drop"}


class OutOfSyncError(RuntimeError):
    """The server's observation differs from the shadow env's: the translation or the server is wrong."""


class _BotStuck(RuntimeError):
    pass


class _BoundedStack(list):
    """The bot's plan stack, raising instead of growing or being polled forever (its replan can loop)."""

    def __init__(self, items: list) -> None:
        super().__init__(items)
        self.lookups = 0

    def append(self, item: object) -> None:
        if len(self) >= MAX_STACK:
            raise _BotStuck(f"the bot's plan grew past {MAX_STACK} subgoals")
        super().append(item)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        self.lookups += 1
        if self.lookups > MAX_REPLAN_LOOKUPS:
            raise _BotStuck("the bot's replanning does not terminate")
        return super().__getitem__(index)


class _Shadow:
    """The local copy of the episode, its bot, and the text the server should show."""

    def __init__(self, data_idx: int) -> None:
        level, seed = level_of(data_idx)
        self.env = make_env(level)
        obs, _ = self.env.reset(seed=seed)  # type: ignore[attr-defined]
        self.scene = text.scene(self.env, obs["image"])
        self.expected = self.scene.observation(self.env.mission)  # type: ignore[attr-defined]
        self.bot: BabyAIBot | None = None
        self.last: int | None = None
        self.turns_to_drop = 0
        self.reward = 0.0
        self.script = self._open_key_boxes()

    def new_bot(self) -> None:
        self.bot = BabyAIBot(self.env)
        self.bot.stack = _BoundedStack(self.bot.stack)
        self.last = None

    def _open_key_boxes(self) -> list[int]:
        """Primitives that open a box hiding a key no other key matches (KeyInBox): the bot cannot see it."""
        grid = self.env.grid  # type: ignore[attr-defined]
        cells = [(i % grid.width, i // grid.width, c) for i, c in enumerate(grid.grid) if c is not None]
        keys = {c.color for _, _, c in cells if c.type == "key"}
        for x, y, c in cells:
            if c.type == "box" and c.contains is not None and c.contains.type == "key" and c.contains.color not in keys:
                plan = text.plan_to_face(self.env, x, y)
                if plan is not None:
                    return [*plan, text.TOGGLE]
        return []

    def advise(self) -> int | None:
        """The bot's next primitive, or None when it cannot help any more."""
        if self.script:
            return self.script.pop(0)
        if self.env.carrying is not None and self.bot is None and self.turns_to_drop < 4:  # type: ignore[attr-defined]
            return self._put_down()
        if self.bot is None:
            self.new_bot()
        for attempt in range(2):
            try:
                self.bot.stack.lookups = 0  # type: ignore[union-attr]
                return int(self.bot.replan(self.last))  # type: ignore[union-attr]
            except DisappearedBoxError:
                if attempt:
                    return None
                self.new_bot()  # the box's content is now on the floor: plan afresh from here
            except (_BotStuck, AssertionError):  # its planner's dead ends (e.g. a key behind a locked door)
                return None
        return None

    def _put_down(self) -> int:
        """Turn until the cell ahead is free, then drop (the bot cannot plan with something in hand)."""
        px, py = self.env.front_pos  # type: ignore[attr-defined]
        if self.env.grid.get(px, py) is None:  # type: ignore[attr-defined]
            return text.DROP
        self.turns_to_drop += 1
        return text.LEFT

    def wording(self, primitive: int) -> str | None:
        """The high-level action with the primitive's effect, or None when there is none."""
        if primitive in _WORDS:
            return _WORDS[primitive]
        px, py = (int(v) for v in self.env.front_pos)  # type: ignore[attr-defined]
        ahead = next((label for label, t in self.scene.targets.items() if (t.x, t.y) == (px, py)), None)
        if primitive == text.PICKUP and ahead is not None:
            return f"pickup {ahead}"
        if primitive == text.DONE and ahead is not None:
            return f"go to {ahead}"
        return None

    def step(self, primitive: int) -> None:
        obs, reward, terminated, truncated, _ = self.env.step(primitive)  # type: ignore[attr-defined]
        self.last = primitive
        self.scene = text.scene(self.env, obs["image"])
        done = bool(terminated or truncated)
        success = bool(terminated and reward > 0)
        self.reward = float(reward) if success else 0.0
        self.expected = self.scene.observation(ending=ending_of(done, bool(terminated), success))


def _reply(mission: str, action: str) -> str:
    return f"Thought: To {mission}, my next step is to {action}.\nAction: {action}"


def solve(client: BaseEnvClient, data_idx: int, max_turns: int = 2000) -> StepOutput:
    """Play ``data_idx`` to its end with the bot, one primitive per ``client.step``; the last output."""
    out = client.reset(data_idx)
    shadow = _Shadow(data_idx)
    mission = shadow.env.mission  # type: ignore[attr-defined]
    _check(shadow, out, data_idx)
    for _ in range(max_turns):
        if out.done:
            break
        primitive = shadow.advise()
        action = shadow.wording(primitive) if primitive is not None else None
        if action is None:
            break  # the bot gave up, or asked for something no text action does
        out = client.step(_reply(mission, action))
        shadow.step(primitive)  # type: ignore[arg-type]
        _check(shadow, out, data_idx)
    return out


#: a GoTo mission as the first observation states it ("Your goal: go to the red ball")
GOTO_GOAL = re.compile(r"Your goal: go to (?:the|a) (.+)")


def sighted_reply(first_observation: str, observation: str) -> str:
    """The sighted expert's reply: ``go to`` the goal object when an available action reaches it, else turn left.
    A first observation without a GoTo mission is a ValueError."""
    goal = GOTO_GOAL.search(first_observation)
    if goal is None:
        raise ValueError("the sighted expert plays GoTo missions only ('Your goal: go to ...'); this item's "
                         f"observation states none: {first_observation[:120]!r}")
    target = goal.group(1).split()
    actions = json.loads(observation[observation.index("Available actions: ") + len("Available actions: "):])
    for action in actions:
        if action.startswith("go to ") and all(w in action.split() for w in target):
            return f"Thought: the {' '.join(target)} is in sight.\nAction: {action}"
    return "Thought: I do not see it yet.\nAction: turn left"


def solve_sighted(client: BaseEnvClient, data_idx: int, max_turns: int = 4) -> StepOutput:
    """Play a GoTo item with :func:`sighted_reply` for at most ``max_turns`` replies (three left turns look every
    way); the last output (not done, or done without success, where the goal was never in sight or not reached)."""
    out = client.reset(data_idx)
    first = out.observation
    for _ in range(max_turns):
        if out.done:
            break
        out = client.step(sighted_reply(first, out.observation))
    return out


def _check(shadow: _Shadow, out: StepOutput, data_idx: int) -> None:
    if out.observation != shadow.expected or abs(out.reward - shadow.reward) > 1e-9:
        raise OutOfSyncError(
            f"babyai item {data_idx}: the server shows (reward {out.reward})\n{out.observation}\nbut the shadow "
            f"env expects (reward {shadow.reward})\n{shadow.expected}"
        )
