"""ReAct reply parsing: exactly one Action, explanatory errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.react import EMPTY_ACTION, MULTIPLE_ACTIONS, NO_ACTION, ActionParseError, parse_react, plain_action


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("Thought: go.\nAction: move forward", "move forward"),
        ("Thought:\nI need planks.\n\nAction:\nget 1 oak logs\n", "get 1 oak logs"),
        ("Action: inventory   ", "inventory"),
        ("Thought: a\nAction: craft 4 oak planks using 1 oak logs\nmore text", "craft 4 oak planks using 1 oak logs"),
    ],
)
def test_parses_the_single_action(reply: str, action: str) -> None:
    assert parse_react(reply) == action


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ("I will move forward", NO_ACTION),
        ("Thought: x\nAction: turn left\nAction: turn right", MULTIPLE_ACTIONS),
        ("Thought: x\nAction:   ", EMPTY_ACTION),
    ],
)
def test_malformed_replies_explain_themselves(reply: str, message: str) -> None:
    with pytest.raises(ActionParseError) as err:
        parse_react(reply)
    assert str(err.value) == message


def test_plain_action_keeps_only_letters_digits_commas_spaces() -> None:
    assert plain_action("  craft 4 oak_planks using 1 oak logs!!  ") == "craft 4 oakplanks using 1 oak logs"
    assert plain_action("go to red ball 1.\t") == "go to red ball 1"


@given(st.text(alphabet=st.characters(blacklist_characters="\n\r"), min_size=1).filter(lambda s: s.strip()))
def test_any_single_line_action_round_trips(action: str) -> None:
    if "Action:" in action:
        return
    assert parse_react(f"Thought: think\nAction: {action}") == action.strip()
