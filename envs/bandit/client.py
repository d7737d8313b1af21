"""The bandit's client: instruction prompt and plain-action parsing."""

from __future__ import annotations

from envs.client import AsyncBaseEnvClient, BaseEnvClient, ClientLogic, agentgym_conversation
from envs.react import plain_action

INSTRUCTION = (
    "You stand before two doors. Reply with your reasoning after 'Thought:' and then exactly one "
    "'Action:' naming the door to open, left or right.\nThought: <reasoning>\nAction: <left or right>"
)


class Spec(ClientLogic):
    env_name = "bandit"
    conversation_start = agentgym_conversation(INSTRUCTION, "OK.")

    def clean_action(self, action: str) -> str:
        return plain_action(action).lower()


class Client(Spec, BaseEnvClient):
    pass


class AsyncClient(Spec, AsyncBaseEnvClient):
    pass
