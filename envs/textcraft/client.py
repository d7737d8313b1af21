"""TextCraft HTTP clients: the crafting instruction prompt and AgentGym's action cleaning.

The prompt explains the three commands (``craft ... using ...``, ``get``, ``inventory``), asks for
``Thought:`` then ``Action:`` and gives AgentGym's three reminders. Actions are cleaned like AgentGym's
TextCraft client: only letters, digits, commas and spaces are kept (``envs.react.plain_action``).
"""

from __future__ import annotations

from envs.client import AsyncBaseEnvClient, BaseEnvClient, ClientLogic, agentgym_conversation
from envs.react import plain_action

INSTRUCTION = (
    "You are given a few useful crafting recipes to craft items in Minecraft. Crafting commands are of "
    'the format "craft [target object] using [input ingredients]". Each turn you reply with one command '
    "and the environment answers with its result.\n\n"
    "Commands:\n"
    '- get [count] [object]: fetch a basic resource from the environment, e.g. "get 1 oak logs". Only '
    "items that cannot be crafted can be fetched; you may fetch as many as you need.\n"
    "- craft [count] [target object] using [count] [ingredient], [count] [ingredient], ...: craft the "
    'target once with exactly the ingredients of one of the given crafting commands, e.g. "craft 4 oak '
    'planks using 1 oak logs". The ingredients must be in your inventory and are used up.\n'
    "- inventory: list the items you are carrying.\n\n"
    'Your goal is to craft the item named after "Goal:". Reply in exactly this format, with a single '
    "command on the line after 'Action:':\n"
    "Thought:\n<your reasoning>\n\n"
    "Action:\n<one command>\n\n"
    "Reminders:\n"
    "1. Always specify the quantity when you use get and craft commands.\n"
    "2. When you use get, give only the item and its quantity; do not say where it comes from.\n"
    "3. You can only use the given crafting commands. A generic ingredient in a command (such as "
    '"planks") may be replaced by a specific type of it (such as "oak planks"), but you cannot use '
    "any other commands."
)

ACK = "OK. I'll follow your instructions and try my best to solve the task."


class Spec(ClientLogic):
    """TextCraft's prompt and AgentGym's action cleaning."""

    env_name = "textcraft"
    conversation_start = agentgym_conversation(INSTRUCTION, ACK)

    def clean_action(self, action: str) -> str:
        """Keep letters, digits, commas and spaces; collapse whitespace (AgentGym's TextCraft cleaning)."""
        return plain_action(action)


class Client(Spec, BaseEnvClient):
    pass


class AsyncClient(Spec, AsyncBaseEnvClient):
    pass
