"""Deep Search HTTP clients: the Search-R1 prompt and its tag parsing.

The model thinks in ``<think>...</think>``, then writes one ``<search>query</search>`` or
``<answer>text</answer>``. The first complete tag of a reply is the action; a reply without one is answered
locally (no HTTP request) with the format reminder, like any unparsable ReAct reply.
"""

from __future__ import annotations

import re

from envs.client import AsyncBaseEnvClient, BaseEnvClient, ClientLogic, agentgym_conversation
from envs.react import ActionParseError

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as you want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>."
)
ACK = "OK. I'll follow your instructions and try my best to solve the task."
TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


class Spec(ClientLogic):
    """The Search-R1 prompt; the action is the reply's first complete <search> or <answer> tag."""

    env_name = "deepsearch"
    conversation_start = agentgym_conversation(INSTRUCTION, ACK)

    def parse(self, reply: str) -> str:
        match = TAG.search(reply)
        if match is None:
            raise ActionParseError("Invalid action: write <search> query </search> to search, or "
                                   "<answer> answer </answer> to answer.")
        return f"<{match.group(1)}>{' '.join(match.group(2).split())}</{match.group(1)}>"


class Client(Spec, BaseEnvClient):
    pass


class AsyncClient(Spec, AsyncBaseEnvClient):
    pass
