"""Text of the environments themselves: instructions, observations and actions of expert episodes.

The tiny default model's tokenizer is trained on this, so it tokenizes what it will read and write.
Episodes run in-process (``envs.local``) on training-split items, in a fixed order. They are recorded
once into ``data/tokenizer_corpus.json.gz`` (``scalinginter build-corpus``), which is committed and is what
``build-model`` reads: SciWorld's simulator plans its gold paths in a different (equally valid) order in
each JVM, so replaying the episodes on two machines would give two tokenizers, and two base models.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from envs.files import atomic_write
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
    return played_episode(env, client, data_idx)[0]


def played_episode(env: str, client: Any, data_idx: int, which: str = "default") -> tuple[list[str], bool]:
    """:func:`recorded_episode` of the expert ``which`` (``envs.registry.expert``), and whether it succeeded."""
    texts: list[str] = []
    out = expert(env, which)(_Recorder(client, texts), data_idx)
    return texts, bool(out.done and out.success)


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


CORPUS_FILE = "data/tokenizer_corpus.json.gz"


def write_corpus(texts: Iterable[str], path: Path) -> Path:
    """Store ``texts`` as gzipped JSON, byte-reproducible (no timestamp in the gzip header), atomically."""
    data = json.dumps({"texts": list(texts)}, ensure_ascii=False, indent=0).encode()
    return atomic_write(path, gzip.compress(data, mtime=0))


def read_corpus(path: Path) -> list[str]:
    """The texts of a corpus file written by ``write_corpus``; a clear error when it is missing or malformed."""
    if not path.exists():
        raise FileNotFoundError(f"tokenizer corpus {path} not found: record one with `scalinginter build-corpus`")
    try:
        texts = json.loads(gzip.decompress(path.read_bytes()))["texts"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a tokenizer corpus (gzipped JSON with a 'texts' list): {err}; "
                         "record it again with `scalinginter build-corpus`") from err
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{path} holds no texts, or texts that are not strings: record it again with "
                         "`scalinginter build-corpus`")
    return texts
