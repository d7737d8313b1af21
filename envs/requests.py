"""The request bodies of AgentGym's wire protocol as the environment server accepts them (``envs.server``):
strict types (an id is a non-negative integer, an action a string of valid UTF-8), AgentGym's aliases (``env_idx``
for ``id``, ``idx`` for ``data_idx``), and the errors a malformed or oversized request gets (422, 413).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from envs.base import EnvError

MAX_ACTION_BYTES = 1 << 20
InstanceId = Annotated[int, Field(strict=True, ge=0, validation_alias=AliasChoices("id", "env_idx"))]


class ActionTooLargeError(EnvError):
    status_code = 413


class RequestShapeError(EnvError):
    status_code = 422


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class IdBody(_Body):
    id: InstanceId


class ResetBody(IdBody):
    data_idx: Annotated[int, Field(strict=True, validation_alias=AliasChoices("data_idx", "idx"))] = 0


class StepBody(IdBody):
    action: Annotated[str, Field(strict=True)]

    @field_validator("action")
    @classmethod
    def _utf8(cls, action: str) -> str:
        try:
            action.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate: applied, it would make every answer unencodable
            raise ValueError(f"the action is not valid UTF-8 (a lone surrogate at character {err.start})") from None
        return action


class BatchBody(_Body):
    steps: list[StepBody] = Field(min_length=1)


class CreateBatchBody(_Body):
    data_idx: list[Annotated[int, Field(strict=True)]] = Field(min_length=1)


class CloseBatchBody(_Body):
    ids: list[Annotated[int, Field(strict=True, ge=0)]] = Field(min_length=1)


def check_action(action: str) -> None:
    if len(action) > MAX_ACTION_BYTES // 4 and len(action.encode()) > MAX_ACTION_BYTES:
        raise ActionTooLargeError(f"action is {len(action.encode())} bytes; the limit is {MAX_ACTION_BYTES} bytes")
