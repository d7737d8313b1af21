"""Scripted solutions of the local WebArena tasks, played through the client like an agent would.

Each task shipped in ``data/webarena/tasks.json`` carries ``scalinginter_solution``: steps such as
``["click", "link", "Laptops"]`` or ``["type", "textbox", "Reply", "Congrats!", 0]`` that name elements by
role and accessible name; the expert finds their ids in the current observation, so it exercises the
accessibility tree, the actions and the evaluators end to end.
"""

from __future__ import annotations

import json
import re

from envs.client import BaseEnvClient, StepOutput
from envs.paths import project_root


def _tasks() -> list[dict]:
    return json.loads((project_root() / "data" / "webarena" / "tasks.json").read_text())


def find_id(observation: str, role: str, name: str) -> int | None:
    """The id of the first element ``[id] role 'name'`` in an observation."""
    pattern = re.compile(rf"\[(\d+)\] {re.escape(role)} {re.escape(repr(name))}(?:\s|$)")
    match = pattern.search(observation)
    return int(match.group(1)) if match else None


def _reply(action: str) -> str:
    return f"Thought:\nFollowing the plan.\n\nAction:\n{action}"


def solve(client: BaseEnvClient, data_idx: int) -> StepOutput:
    """Reset ``data_idx`` and play its scripted solution; returns the last output."""
    out = client.reset(data_idx)
    for step in _tasks()[data_idx]["scalinginter_solution"]:
        kind = step[0]
        if kind == "stop":
            return client.step(_reply(f"stop [{step[1]}]"))
        element = find_id(out.observation, step[1], step[2])
        if element is None:
            return client.step(_reply(f"stop [could not find {step[1]} {step[2]!r}]"))
        if kind == "click":
            out = client.step(_reply(f"click [{element}]"))
        elif kind == "type":
            out = client.step(_reply(f"type [{element}] [{step[3]}] [{step[4]}]"))
    return out
