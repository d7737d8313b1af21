"""ReAct reply parsing: ``Thought: ...`` then exactly one ``Action: ...``.

A malformed reply never reaches the server: the parser raises :class:`ActionParseError`, whose message
is the explanatory observation the agent sees (reward 0, the turn still counts).
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"Action:[ \t]*\n?[ \t]*(.*)")

MULTIPLE_ACTIONS = "Error: Only one 'Action' is allowed per response. Please adjust your response."
NO_ACTION = (
    "Error: no 'Action:' found. Reply in the format 'Thought:\\n<your reasoning>\\n\\nAction:\\n<one action>'."
)
EMPTY_ACTION = "Error: the 'Action:' line is empty. Write exactly one action after 'Action:'."


class ActionParseError(ValueError):
    """The reply is not a valid ReAct reply; ``str(err)`` is the observation to show the agent."""


def parse_react(reply: str) -> str:
    """Return the action of a ReAct reply (the text after its single ``Action:``, to end of line)."""
    matches = _ACTION.findall(reply)
    if not matches:
        raise ActionParseError(NO_ACTION)
    if len(matches) > 1:
        raise ActionParseError(MULTIPLE_ACTIONS)
    action = matches[0].strip()
    if not action:
        raise ActionParseError(EMPTY_ACTION)
    return action


_NOT_PLAIN = re.compile(r"[^A-Za-z0-9, ]")
_SPACES = re.compile(r"\s+")


def plain_action(action: str) -> str:
    """Keep letters, digits, commas and spaces, collapse whitespace (TextCraft and BabyAI actions)."""
    return _SPACES.sub(" ", _NOT_PLAIN.sub("", action)).strip()
