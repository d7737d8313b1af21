"""SciWorld HTTP clients: the ScienceWorld ReAct instruction prompt, action cleaning and the first observation.

The prompt lists the 25 action templates AgentGym's SciWorld agent is shown and asks for
``Thought: ...`` then ``Action: ...``. As in AgentGym, the agent's first observation is the task
description, a newline, then the look-around text of the reset. No simulator is imported here.
"""

from __future__ import annotations

from typing import Any

from envs.client import AsyncBaseEnvClient, BaseEnvClient, ClientLogic, agentgym_conversation
from envs.react import EMPTY_ACTION, ActionParseError

# (template, what it does): OBJ/OBJ2 are object names and LOC a room name, as the observations show them.
ACTIONS: tuple[tuple[str, str], ...] = (
    ("open OBJ", "open a container or a door"),
    ("close OBJ", "close a container or a door"),
    ("activate OBJ", "switch a device on"),
    ("deactivate OBJ", "switch a device off"),
    ("connect OBJ to OBJ2", "join two electrical terminals or components with a wire"),
    ("use OBJ on OBJ2", "apply a tool or device to something, e.g. a thermometer on a substance"),
    ("look around", "describe the room you are in"),
    ("look at OBJ", "describe one object closely"),
    ("look in OBJ", "list what is inside a container"),
    ("examine OBJ", "inspect an object in detail"),
    ("read OBJ", "read the text on an object, such as a recipe or a note"),
    ("move OBJ to OBJ2", "place an object into a container or onto a surface"),
    ("pick up OBJ", "take an object into your inventory"),
    ("put down OBJ", "drop an object from your inventory here"),
    ("pour OBJ in OBJ2", "pour a container's contents into another container"),
    ("dunk OBJ in OBJ2", "dip a container into a liquid"),
    ("mix OBJ", "chemically mix what a container holds"),
    ("go to LOC", "walk to an adjacent room (its door must be open)"),
    ("eat OBJ", "eat a food item"),
    ("flush OBJ", "flush a toilet"),
    ("focus on OBJ", "declare the object the task is about; focusing on a wrong object can fail the task"),
    ("wait", "let 10 time steps pass"),
    ("wait1", "let a single time step pass"),
    ("task", "show the task description again"),
    ("inventory", "list what you are carrying"),
)

INSTRUCTION = (
    "You are an agent in ScienceWorld, a text simulation of an elementary-school science lab spread over "
    "a house and its surroundings. Each turn you receive an observation and reply with exactly one action "
    "that brings you closer to completing the task.\n\n"
    "Actions (OBJ and OBJ2 stand for object names and LOC for a room name, written as the observations "
    "show them):\n"
    + "\n".join(f"- {template}: {meaning}" for template, meaning in ACTIONS)
    + "\n\nIf the simulator says a request is ambiguous and lists numbered options, reply with the number of "
    'the option you mean as the action. Any other text is answered with "No known action matches that '
    'input."\n\n'
    "Reply in exactly this format, with a single action on the line after 'Action:':\n"
    "Thought:\n<your reasoning about what you observed and what to do next>\n\n"
    "Action:\n<one action>"
)

ACK = "OK. I will think step by step and reply with one Thought and exactly one Action each turn."


class Spec(ClientLogic):
    """SciWorld's prompt and its reply/observation conventions."""

    env_name = "sciworld"
    conversation_start = agentgym_conversation(INSTRUCTION, ACK)

    def clean_action(self, action: str) -> str:
        """Drop a trailing end-of-sequence token ``</s>`` and surrounding whitespace; nothing left is an error."""
        action = action.strip()
        if action.endswith("</s>"):
            action = action[: -len("</s>")].strip()
        if not action:
            raise ActionParseError(EMPTY_ACTION)
        return action

    def format_reset(self, payload: dict[str, Any]) -> str:
        """AgentGym's first observation: task description, newline, look-around text."""
        description = payload.get("task_description") or (payload.get("info") or {}).get("task_description", "")
        return f"{description}\n{payload['observation']}"


class Client(Spec, BaseEnvClient):
    pass


class AsyncClient(Spec, AsyncBaseEnvClient):
    pass
