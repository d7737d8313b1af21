"""BabyAI text: the observation text, the high-level action list, and their expansion into primitives.

The description is read from the egocentric image minigrid already computes each step
(``obs["image"]``: ``view x view`` cells of ``(type, colour, state)``, the agent at the bottom middle
facing up, unseen cells typed ``unseen``), so a step costs a few tens of microseconds of text on top of
minigrid's own step. Visible objects are sorted by distance and numbered per name ("red ball 1", "red
ball 2"); those labels name the targets of the high-level actions.

The action list is recomputed every step without path search: an action is listed when its target is
in sight and the agent's state allows it. A path is searched (BFS over the full grid, over states
``(cell, direction)`` with turn and forward moves) only when a navigating action is chosen; when no path
exists the action fails with a message and the state is unchanged.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass

import numpy as np
from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT, OBJECT_TO_IDX, STATE_TO_IDX

# minigrid's primitive actions (MiniGridEnv.Actions).
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)

UNKNOWN_ACTION = "The action is not recognized. Please check valid actions."
CHECK = "check available actions"

_EMPTY, _WALL, _DOOR = OBJECT_TO_IDX["empty"], OBJECT_TO_IDX["wall"], OBJECT_TO_IDX["door"]
_GOAL = OBJECT_TO_IDX["goal"]
_PICKABLE = frozenset(OBJECT_TO_IDX[t] for t in ("key", "ball", "box"))
_OPEN, _CLOSED, _LOCKED = STATE_TO_IDX["open"], STATE_TO_IDX["closed"], STATE_TO_IDX["locked"]
_STATE_NAME = {v: k for k, v in STATE_TO_IDX.items()}
_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))  # minigrid's DIR_TO_VEC as plain ints (0 = east, 1 = south)
_FIXED = {"turn left": LEFT, "turn right": RIGHT, "move forward": FORWARD, "toggle": TOGGLE, "drop": DROP}
# Prefix actions, longest first so "toggle and go through" is not read as something shorter.
_PREFIXES = ("toggle and go through ", "go through ", "go to ", "pickup ", "pick up ")


def object_name(type_idx: int, color_idx: int, state: int) -> str:
    """The display name of an encoded cell: "red ball", "blue locked door"."""
    kind = IDX_TO_OBJECT[type_idx]
    if type_idx == _DOOR:
        return f"{IDX_TO_COLOR[color_idx]} {_STATE_NAME[state]} door"
    return f"{IDX_TO_COLOR[color_idx]} {kind}"


def _thing(cell: object | None) -> str:
    """Display name of a world object (for messages), "wall" for walls."""
    if cell is None:
        return "nothing"
    if cell.type == "door":  # type: ignore[attr-defined]
        state = "open" if cell.is_open else "locked" if cell.is_locked else "closed"  # type: ignore[attr-defined]
        return f"{cell.color} {state} door"  # type: ignore[attr-defined]
    return "wall" if cell.type == "wall" else f"{cell.color} {cell.type}"  # type: ignore[attr-defined]


@dataclass(slots=True)
class Target:
    """A numbered visible object: its encoded type and state and its absolute grid position."""

    type_idx: int
    state: int
    color: str
    x: int
    y: int


@dataclass(slots=True)
class Scene:
    """What the agent perceives now: the description, the valid action list and the labelled targets."""

    description: str
    actions: list[str]
    targets: dict[str, Target]
    goal: tuple[int, int] | None

    def actions_line(self) -> str:
        """``Available actions: ["turn left", ...]`` (AgentGym's list format)."""
        return "Available actions: " + json.dumps(self.actions)

    def observation(self, mission: str | None = None, ending: str = "") -> str:
        """The observation text: goal line (after reset), description, ending line (if any), actions."""
        head = f"Your goal: {mission}\n" if mission is not None else ""
        tail = f"{ending}\n" if ending else ""
        return f"{head}{self.description}\n{tail}{self.actions_line()}"


def _position(front: int, right: int) -> str:
    if right == 0:
        return f"right in front of you {front} steps away"
    side = "right" if right > 0 else "left"
    return f"{front} steps in front of you and {abs(right)} steps to your {side}"


def _visible(image: np.ndarray) -> list[tuple[int, int, int, int, int, int]]:
    """Visible objects as ``(distance, front, right, type, colour, state)``, nearest first."""
    view = image.shape[0]
    half, depth = view // 2, view - 1
    xs, ys = np.nonzero(image[:, :, 0] >= _DOOR)  # door, key, ball, box, goal, lava
    found = []
    for i, j, (t, c, s) in zip(xs.tolist(), ys.tolist(), image[xs, ys].tolist(), strict=True):
        front, right = depth - j, i - half
        if front or right:  # the agent's own cell shows what it carries
            found.append((front + abs(right), front, right, t, c, s))
    found.sort()
    return found


def scene(env: object, image: np.ndarray) -> Scene:
    """Describe the agent's view and list the actions valid now (``env`` is the unwrapped minigrid env)."""
    px, py = (int(v) for v in env.agent_pos)  # type: ignore[attr-defined]  # may hold numpy ints
    fx, fy = _VEC[env.agent_dir]  # type: ignore[attr-defined]
    rx, ry = -fy, fx
    carrying = env.carrying  # type: ignore[attr-defined]
    counts: dict[str, int] = {}
    targets: dict[str, Target] = {}
    ahead: dict[int, str] = {}
    lines: list[str] = []
    pickups: list[str] = []
    gotos: list[str] = []
    doors: list[str] = []
    goal = None
    for _, front, right, t, c, s in _visible(image):
        name = object_name(t, c, s)
        n = counts[name] = counts.get(name, 0) + 1
        label = f"{name} {n}"
        x, y = px + front * fx + right * rx, py + front * fy + right * ry
        targets[label] = Target(t, s, IDX_TO_COLOR[c], x, y)
        lines.append(f"There is a {label} {_position(front, right)}.")
        if right == 0:
            ahead[front] = label
        if t == _GOAL:
            goal = goal or (x, y)
            continue
        gotos.append(f"go to {label}")
        if t in _PICKABLE and carrying is None:
            pickups.append(f"pickup {label}")
        elif t == _DOOR:
            if s == _OPEN:
                doors.append(f"go through {label}")
            elif s == _CLOSED or _has_key(carrying, IDX_TO_COLOR[c]):
                doors.append(f"toggle and go through {label}")
    parts = ["In front of you in this room, you can see several objects: " + " ".join(lines)] if lines else [
        "You cannot see any objects within sight."]
    parts.append(_facing(image, ahead))
    parts.append(f"You are carrying a {carrying.color} {carrying.type}." if carrying else
                 "You are not carrying anything.")
    actions = _local_actions(env.grid.get(px + fx, py + fy), carrying) + pickups + gotos + doors  # type: ignore[attr-defined]
    if goal is not None:
        actions.append("go to goal")
    actions.append(CHECK)
    return Scene(" ".join(p for p in parts if p), actions, targets, goal)


def _local_actions(fwd: object | None, carrying: object | None) -> list[str]:
    """The actions that depend only on the cell ahead and the carried object."""
    actions = ["turn left", "turn right"]
    if fwd is None or fwd.can_overlap():  # type: ignore[attr-defined]
        actions.append("move forward")
    if _toggle_problem(fwd, carrying) is None:
        actions.append("toggle")
    if carrying is not None and fwd is None:
        actions.append("drop")
    return actions


def _facing(image: np.ndarray, ahead: dict[int, str]) -> str:
    """What stands straight ahead: the first non-empty visible cell of the agent's column."""
    view = image.shape[0]
    column = image[view // 2, :, 0].tolist()
    for j in range(view - 2, -1, -1):
        t = column[j]
        if t == _EMPTY:
            continue
        steps = view - 1 - j
        if t == _WALL:
            return f"You are facing a wall {steps} steps away."
        if steps in ahead:
            return f"You are facing a {ahead[steps]} {steps} steps away."
        return ""
    return ""


def _has_key(carrying: object | None, color: str) -> bool:
    return carrying is not None and carrying.type == "key" and carrying.color == color  # type: ignore[attr-defined]


def _toggle_problem(fwd: object | None, carrying: object | None) -> str | None:
    """Why ``toggle`` would do nothing now, or None when it acts (doors, boxes)."""
    if fwd is None:
        return "There is nothing in front of you to toggle."
    if fwd.type == "box":  # type: ignore[attr-defined]
        return None
    if fwd.type != "door":  # type: ignore[attr-defined]
        return f"You cannot toggle the {_thing(fwd)} in front of you."
    if fwd.is_locked and not _has_key(carrying, fwd.color):  # type: ignore[attr-defined]
        return f"You cannot toggle the {_thing(fwd)}, as you are not carrying a {fwd.color} key."  # type: ignore[attr-defined]
    return None


def expand(env: object, action: str, view: Scene) -> list[int] | str:
    """The primitive actions of a normalised high-level action, or the reason it cannot be done now."""
    primitive = _FIXED.get(action)
    if primitive is not None:
        return _primitive(env, primitive)
    if action == "go to goal":
        if view.goal is None:
            return "You cannot go to the goal, as there is no goal in sight."
        plan = _path(env, _facing_states(*view.goal))
        return "You cannot go to the goal, as there is no path leading to it." if plan is None else plan[0] + [FORWARD]
    for prefix in _PREFIXES:
        if action.startswith(prefix):
            label = action[len(prefix):]
            target = view.targets.get(label) or view.targets.get(f"{label} 1")
            if target is None:
                return f"There is no {label} in sight. Please check valid actions."
            return _HANDLERS[prefix](env, target, label)
    return UNKNOWN_ACTION


def _primitive(env: object, action: int) -> list[int] | str:
    if action in (LEFT, RIGHT):
        return [action]
    px, py = env.agent_pos  # type: ignore[attr-defined]
    fx, fy = _VEC[env.agent_dir]  # type: ignore[attr-defined]
    fwd = env.grid.get(px + fx, py + fy)  # type: ignore[attr-defined]
    carrying = env.carrying  # type: ignore[attr-defined]
    if action == FORWARD:
        if fwd is None or fwd.can_overlap():
            return [FORWARD]
        return f"There is a {_thing(fwd)} in front of you, you can't move forward."
    if action == TOGGLE:
        problem = _toggle_problem(fwd, carrying)
        return [TOGGLE] if problem is None else problem
    if carrying is None:
        return "You cannot drop anything, as you are not carrying anything."
    if fwd is not None:
        return f"You cannot drop the {_thing(carrying)}, as there is a {_thing(fwd)} in front of you."
    return [DROP]


def _go_to(env: object, target: Target, label: str) -> list[int] | str:
    plan = _path(env, _facing_states(target.x, target.y))
    if plan is None:
        return f"You cannot go to {label}, as there is no path leading to it."
    # Already facing it: wait one step (minigrid's no-op `done`), so that minigrid checks a "go to"
    # mission that is already met instead of the agent being stuck with nothing to do.
    return plan[0] or [DONE]


def _pickup(env: object, target: Target, label: str) -> list[int] | str:
    if target.type_idx not in _PICKABLE:
        return f"You cannot pickup {label}, as it cannot be picked up."
    carrying = env.carrying  # type: ignore[attr-defined]
    if carrying is not None:
        return f"You cannot pickup {label}, as you are already carrying a {_thing(carrying)}."
    plan = _path(env, _facing_states(target.x, target.y))
    if plan is None:
        return f"You cannot pickup {label}, as there is no path leading to it."
    return plan[0] + [PICKUP]


def _go_through(env: object, target: Target, label: str) -> list[int] | str:
    if target.type_idx != _DOOR:
        return f"You cannot go through {label}, as it is not a door."
    if target.state != _OPEN:
        return f"You cannot go through {label}, as it is closed. You should toggle it first."
    free = _free_cells(env)
    w = env.width  # type: ignore[attr-defined]
    inside = {(target.x, target.y, d) for d, (vx, vy) in enumerate(_VEC) if free[(target.y + vy) * w + target.x + vx]}
    plan = _path(env, inside, free)
    if plan is None:
        return f"You cannot go through {label}, as there is no path leading to it."
    return plan[0] + [FORWARD]


def _toggle_through(env: object, target: Target, label: str) -> list[int] | str:
    if target.type_idx != _DOOR:
        return f"You cannot toggle and go through {label}, as it is not a door."
    if target.state == _OPEN:
        return f"You cannot toggle and go through {label}, as it is already open. Use: go through {label}"
    if target.state == _LOCKED and not _has_key(env.carrying, target.color):  # type: ignore[attr-defined]
        return f"You cannot toggle and go through {label}, as you are not carrying a {target.color} key."
    free = _free_cells(env)
    plan = _path(env, _facing_states(target.x, target.y), free)
    if plan is None:
        return f"You cannot toggle and go through {label}, as there is no path leading to it."
    vx, vy = _VEC[plan[1]]
    beyond_free = free[(target.y + vy) * env.width + target.x + vx]  # type: ignore[attr-defined]
    return plan[0] + ([TOGGLE, FORWARD, FORWARD] if beyond_free else [TOGGLE, FORWARD])


_HANDLERS = {
    "toggle and go through ": _toggle_through,
    "go through ": _go_through,
    "go to ": _go_to,
    "pickup ": _pickup,
    "pick up ": _pickup,
}


def plan_to_face(env: object, x: int, y: int) -> list[int] | None:
    """Fewest turn/forward primitives to stand facing cell ``(x, y)``; None when unreachable."""
    plan = _path(env, _facing_states(x, y))
    return None if plan is None else plan[0]


def _facing_states(x: int, y: int) -> set[tuple[int, int, int]]:
    """The ``(x, y, direction)`` states from which the agent faces cell ``(x, y)``."""
    return {(x - vx, y - vy, d) for d, (vx, vy) in enumerate(_VEC)}


def _free_cells(env: object) -> list[bool]:
    """Per cell (row-major): can the agent stand there? Lava counts as blocked, so paths avoid it."""
    return [c is None or (c.can_overlap() and c.type != "lava") for c in env.grid.grid]  # type: ignore[attr-defined]


def _path(
    env: object, goals: set[tuple[int, int, int]], free: list[bool] | None = None
) -> tuple[list[int], int] | None:
    """Fewest turn/forward primitives from the agent's state to any goal state, and the final direction."""
    w, h = env.width, env.height  # type: ignore[attr-defined]
    free = free if free is not None else _free_cells(env)
    px, py = env.agent_pos  # type: ignore[attr-defined]
    start = ((py * w + px) << 2) | env.agent_dir  # type: ignore[attr-defined]
    wanted = {((y * w + x) << 2) | d for x, y, d in goals if 0 <= x < w and 0 <= y < h}
    parent: dict[int, tuple[int, int]] = {start: (-1, -1)}
    queue = deque([start])
    end = start if start in wanted else -1
    while queue and end < 0:
        state = queue.popleft()
        cell, d = state >> 2, state & 3
        x, y = cell % w + _VEC[d][0], cell // w + _VEC[d][1]
        moves = [(LEFT, (cell << 2) | ((d - 1) & 3)), (RIGHT, (cell << 2) | ((d + 1) & 3))]
        if 0 <= x < w and 0 <= y < h and free[y * w + x]:
            moves.append((FORWARD, ((y * w + x) << 2) | d))
        for action, nxt in moves:
            if nxt not in parent:
                parent[nxt] = (state, action)
                if nxt in wanted:
                    end = nxt
                    break
                queue.append(nxt)
    if end < 0:
        return None
    actions: list[int] = []
    state = end
    while state != start:
        state, action = parent[state]
        actions.append(action)
    return actions[::-1], end & 3
