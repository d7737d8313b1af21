"""Where a run's environment servers are: the one parser of the text that carries them.

The text travels through ``--url``, ``SCALINGINTER_ENV_URL``, DVC stage commands and Prefect parameters in three
forms: ``URL`` (one server), ``URL1,URL2`` (replicas of one environment's server) and
``env=URL1,URL2;env2=URL`` (a mixed run: each environment's own servers). :meth:`ServerUrls.parse` reads any of
them, or a list or mapping, once, into a typed value; everything past the edge asks it for an environment's
replicas, and :meth:`ServerUrls.text` writes the form back for a subprocess.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: an ``env=`` prefix (an environment's name, then ``=`` before any ``://``)
_PAIR = re.compile(r"^\s*([A-Za-z_][\w-]*)\s*=")


def _replicas(value: str | Sequence[str]) -> tuple[str, ...]:
    parts = value.split(",") if isinstance(value, str) else value
    return tuple(u.strip().rstrip("/") for u in parts if u.strip())


@dataclass(frozen=True)
class ServerUrls:
    """Each environment's server replicas (base URLs), for the environments of one run."""

    servers: Mapping[str, tuple[str, ...]]

    @classmethod
    def parse(cls, value: str | Sequence[str] | Mapping[str, str | Sequence[str]] | ServerUrls,
              envs: Sequence[str]) -> ServerUrls:
        """``value`` for the run of ``envs``: one environment takes a URL, replicas or ``env=`` pairs naming it;
        several take ``env=URL`` pairs (``;``-separated) or a mapping, one entry each. A missing or unknown
        environment, or an environment without a URL, is an error that names it."""
        if isinstance(value, ServerUrls):
            servers = dict(value.servers)
        elif isinstance(value, Mapping):
            servers = {e: _replicas(v) for e, v in value.items()}
        elif isinstance(value, str) and _PAIR.match(value):
            servers = {}
            for pair in (p.strip() for p in value.split(";") if p.strip()):
                env, sep, urls = pair.partition("=")
                if not sep or not _PAIR.match(pair) or env.strip() not in envs:
                    raise ValueError(f"environment server {pair!r}: a mixed run takes ENV=URL for each of "
                                     f"{', '.join(envs)}")
                servers[env.strip()] = _replicas(urls)
        elif len(envs) == 1:
            servers = {envs[0]: _replicas(value)}
        else:
            raise ValueError(f"environment server {value!r}: a mixed run takes ENV=URL pairs separated by ';', one for "
                             f"each of {', '.join(envs)}")
        unknown = [e for e in servers if e not in envs]
        if unknown:
            raise ValueError(f"environment server for {', '.join(unknown)}: this run's environments are "
                             f"{', '.join(envs)}")
        missing = [e for e in envs if not servers.get(e)]
        if missing:
            raise ValueError(f"no environment server URL for {', '.join(missing)}"
                             + (": a mixed run takes one per environment (ENV=URL pairs separated by ';')"
                                if len(envs) > 1 else ""))
        return cls({e: servers[e] for e in envs})

    def replicas(self, env: str | None = None) -> tuple[str, ...]:
        """The servers of ``env`` (default: the run's one environment)."""
        if env is None:
            if len(self.servers) != 1:
                raise ValueError(f"a run of {', '.join(self.servers)} has servers per environment: name one")
            env = next(iter(self.servers))
        return self.servers[env]

    def text(self) -> str:
        """The form a subprocess takes back: replicas joined by ``,``; several environments as ``env=...;...``."""
        if len(self.servers) == 1:
            return ",".join(next(iter(self.servers.values())))
        return ";".join(f"{e}={','.join(r)}" for e, r in self.servers.items())
