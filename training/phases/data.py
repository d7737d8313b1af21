"""The items a phase trains on, step by step: an endless seeded order over one environment's split
(:class:`DataStream`), or a mixed run's share of each environment's (:class:`MixedData`). A position is all
the state either has, so a resumed phase takes the same items next."""

from __future__ import annotations

import random
from collections.abc import Sequence

from envs.splits import load_split
from training.phases.mixed import allocation, shares, tag
from training.settings.config import TrainConfig


class DataStream:
    """An endless, seeded order over the split's items (or the config's own item list); ``position`` is all
    the state it has."""

    def __init__(self, env: str, config: TrainConfig, position: int = 0) -> None:
        self.seed, self.position = config.seed, position
        if config.items:
            self.items = list(config.items)
            return
        rows = load_split(env, config.split)
        if config.sub_tasks:
            rows = [r for r in rows if r["sub_task"] in config.sub_tasks]
        if not rows:
            raise ValueError(f"no {env} items in split {config.split!r} with sub_tasks {config.sub_tasks}")
        self.items = [r["item_id"] for r in rows]

    def take(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self.items))
            order = list(self.items)
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            out.append(order[index])
            self.position += 1
        return out


class MixedData:
    """Every environment's own seeded item order; a step takes ``allocation`` items of each, tagged."""

    def __init__(self, envs: Sequence[str], config: TrainConfig, position: int = 0) -> None:
        self.batch = config.batch_items
        self.shares = shares(envs, config)
        self.counts = allocation({e: s.weight for e, s in self.shares.items()}, self.batch)
        self.streams = {e: DataStream(e, config.model_copy(update={"sub_tasks": s.sub_tasks, "items": None}))
                        for e, s in self.shares.items()}
        self.position = position

    def take(self, n: int) -> list[str]:
        if n != self.batch:
            raise ValueError(f"a mixed run takes whole steps of {self.batch} items, not {n}")
        step = self.position // self.batch
        out = []
        for env, stream in self.streams.items():
            stream.position = step * self.counts[env]
            out += [tag(env, i) for i in stream.take(self.counts[env])]
        self.position += n
        return out
