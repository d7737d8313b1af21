"""An in-process client with the same interface as ``BaseEnvClient`` (no HTTP, no server).

For building corpora from expert episodes and for fast tests of agents; anything that measures or
trains against environments goes through the real HTTP server.
"""

from __future__ import annotations

from envs.base import Backend
from envs.client import ClientLogic, StepOutput
from envs.registry import load_backend, spec_class


class LocalEnvClient(ClientLogic):
    """One environment instance called directly."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.env = backend.new_instance()
        self.id = 0

    def reset(self, data_idx: int) -> StepOutput:
        self.backend.check_index(data_idx)
        payload = self.env.reset(data_idx).to_wire()
        return self._output(payload, self.format_reset(payload))

    def step(self, reply: str) -> StepOutput:
        action = self._prepare(reply)
        if isinstance(action, StepOutput):
            return action
        return self._output(self.env.step(action).to_wire())

    def observe(self) -> str:
        return self.env.observe()

    def available_actions(self) -> list[str]:
        return self.env.available_actions()

    def close(self) -> None:
        self.env.close()


def local_client(env: str, backend: Backend | None = None) -> LocalEnvClient:
    """An in-process client of ``env`` with that environment's prompt and parser."""
    cls = type(f"Local{env.title()}Client", (spec_class(env), LocalEnvClient), {})
    return cls(backend if backend is not None else load_backend(env))
