"""Text of the environments themselves: instructions, observations and actions of expert episodes.

The tiny default model's tokenizer is trained on this, so it tokenizes what it will read and write.
Episodes run in-process (``envs.local``) on training-split items, in a fixed order: same arguments, same
corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from envs.local import local_client
from envs.registry import SERVED, expert, spec_class
from envs.splits import item_index, load_split


class _Recorder:
    """Wraps a client and keeps every observation and reply of an episode."""

    def __init__(self, client: Any, texts: list[str]) -> None:
        self._client, self._texts = client, texts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def reset(self, data_idx: int) -> Any:
        out = self._client.reset(data_idx)
        self._texts.append(out.observation)
        return out

    def step(self, reply: str) -> Any:
        out = self._client.step(reply)
        self._texts += [reply, out.observation]
        return out


def recorded_episode(env: str, client: Any, data_idx: int) -> list[str]:
    """Play the expert on ``data_idx``: [first observation, reply 1, observation 1, reply 2, ...]."""
    texts: list[str] = []
    expert(env)(_Recorder(client, texts), data_idx)
    return texts


def expert_corpus(episodes: dict[str, int] | None = None) -> Iterator[str]:
    """Instructions of every environment, then the text of ``episodes[env]`` expert episodes each."""
    episodes = episodes if episodes is not None else {env: 8 for env in SERVED}
    for env in SERVED:
        human, gpt = spec_class(env).conversation_start
        yield human["value"]
        yield gpt["value"]
    for env, count in episodes.items():
        client = local_client(env)
        try:
            for item in load_split(env, "train")[:count]:
                yield from recorded_episode(env, client, item_index(item["item_id"]))
        finally:
            client.close()
            client.backend.shutdown()
