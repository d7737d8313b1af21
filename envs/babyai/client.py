"""BabyAI HTTP clients: the exploration instruction prompt and AgentGym's action cleaning.

The prompt describes the grid world, the high-level action grammar (turn left/right, move forward,
go to / pickup <object> <n>, go through / toggle and go through <door> <n>, toggle, drop, go to goal,
check available actions) and asks for ``Thought:`` then ``Action:``. Actions are cleaned like
AgentGym's BabyAI client and server: letters, digits, commas and spaces only, lower-cased.
"""

from __future__ import annotations

from envs.client import AsyncBaseEnvClient, BaseEnvClient, ClientLogic, agentgym_conversation
from envs.react import plain_action

INSTRUCTION = (
    "You are an exploration master who wants to finish every goal you are given. Every round I will give "
    "you an observation of a grid world and the actions you can take; you have to respond with one "
    "action. The observation lists the objects you can see (numbered per kind, nearest first, e.g. "
    '"red ball 1") with how many steps in front of you and to your left or right they are, what you are '
    "facing, and what you are carrying.\n\n"
    "Actions:\n"
    "- turn left / turn right: turn 90 degrees on the spot.\n"
    "- move forward: move one step ahead.\n"
    "- go to <object> <n>: walk to the object and face it, e.g. \"go to red ball 1\".\n"
    "- pickup <object> <n>: walk to the object and pick it up (you can carry one object at a time).\n"
    "- drop: put the object you carry on the empty cell in front of you.\n"
    "- toggle: open or close the door in front of you (a locked door needs a key of its colour), or "
    "open the box in front of you.\n"
    "- go through <door> <n>: walk through an open door, e.g. \"go through blue open door 1\".\n"
    "- toggle and go through <door> <n>: walk to a closed (or, with its key, locked) door, open it and "
    "walk through.\n"
    "- go to goal: walk onto the goal square, when you see one.\n"
    "- check available actions: list the actions you can take now.\n"
    "Use only the actions in the observation's list of available actions, with the object names and "
    "numbers exactly as given there.\n\n"
    "Reply in exactly this format, with a single action on the line after 'Action:':\n"
    "Thought:\n<your reasoning>\n\n"
    "Action:\n<one action>"
)

ACK = "OK. I'll follow your instructions and try my best to solve the task."


class Spec(ClientLogic):
    """BabyAI's prompt and action cleaning."""

    env_name = "babyai"
    conversation_start = agentgym_conversation(INSTRUCTION, ACK)

    def clean_action(self, action: str) -> str:
        """Letters, digits, commas and spaces, lower-cased (AgentGym's BabyAI client and server)."""
        return plain_action(action).lower()


class Client(Spec, BaseEnvClient):
    pass


class AsyncClient(Spec, AsyncBaseEnvClient):
    pass
