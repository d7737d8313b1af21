"""HTTP clients for the environment servers, in sync and async forms.

One client object is one environment instance on a server (``POST /create`` in the constructor). A
client carries its environment's instruction prompt (``conversation_start``, AgentGym's format) and
parses ReAct replies locally: a malformed reply yields the explanatory observation without a server
call. Server errors are raised as :class:`EnvServerError` with the server's message, never turned
into a zero reward. Reuse one ``httpx.Client`` across many instances (pass ``http=``), open and reset a
whole rollout's instances in one request with :func:`open_many` / :func:`aopen_many`, step a whole round in
one with :func:`step_many` / :func:`astep_many`, and close them in one with :func:`close_many` /
:func:`aclose_many`.

    client = BabyAIClient("http://127.0.0.1:8000")
    first = client.reset(3)
    out = client.step("Thought: the ball is ahead.\\nAction: move forward")
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from envs.react import ActionParseError, parse_react

TOKEN_ENV_VAR = "SCALINGINTER_ENV_TOKEN"


@dataclass
class StepOutput:
    """One turn's result as the agent sees it.

    ``reward`` is the trajectory's normalised reward so far; a malformed reply earns nothing and leaves
    it where it was. ``sent`` is False when the reply was rejected locally (no server call).
    """

    observation: str
    reward: float = 0.0
    score: float = 0.0
    done: bool = False
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    sent: bool = True
    error: str | None = None  # set by step_many(partial=True) when this instance's simulator failed


class EnvServerError(RuntimeError):
    """The server answered with an error status, or could not be reached.

    ``retryable`` is true when repeating the request is safe and may succeed: the connection was never
    made (the request cannot have been applied), or the server said it is full (429/503). ``payload`` is
    the server's JSON error body (``/step_batch`` puts the results of the instances it did step there).
    """

    def __init__(
        self, message: str, status_code: int | None = None, *, retryable: bool = False, payload: Any = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retryable = retryable or status_code in (429, 503)
        self.payload = payload if payload is not None else {}


def _transport_error(method: str, path: str, base_url: object, err: httpx.TransportError) -> EnvServerError:
    return EnvServerError(
        f"{method} {path}: cannot reach {base_url}: {type(err).__name__}: {err}",
        retryable=isinstance(err, httpx.ConnectError),
    )


def _headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else os.environ.get(TOKEN_ENV_VAR)
    return {"Authorization": f"Bearer {token}"} if token else {}


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CAs; ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` honoured), built once per
    process and shared by every client here: httpx builds one for each new client, ~20 ms of CPU (a health poll
    every 0.1 s spent ~15% of a core on it while a vLLM server started beside it)."""
    return httpx.create_ssl_context()


def env_http(base_url: str, *, token: str | None = None, timeout: float = 120.0) -> httpx.Client:
    """The one way to open an HTTP session to an environment server: ``token`` (default: the
    ``SCALINGINTER_ENV_TOKEN`` environment variable) is sent as a bearer token on every request."""
    return httpx.Client(base_url=base_url, timeout=timeout, headers=_headers(token), verify=tls_context())


def async_env_http(base_url: str, *, token: str | None = None, timeout: float = 120.0) -> httpx.AsyncClient:
    """:func:`env_http` for asyncio."""
    return httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=_headers(token), verify=tls_context())


def _check(response: httpx.Response) -> Any:
    if response.is_success:
        return response.json()
    try:
        payload = response.json()
        detail = payload.get("detail", response.text) if isinstance(payload, dict) else response.text
    except ValueError:
        payload, detail = {}, response.text
    raise EnvServerError(
        f"{response.request.method} {response.request.url.path} -> HTTP {response.status_code}: {detail}",
        response.status_code,
        payload=payload,
    )


def server_capacity(url: str, token: str | None = None, timeout: float = 30.0) -> int | None:
    """How many live instances the server at ``url`` holds at once: its /health ``capacity`` (SciWorld's JVM
    pool, WebArena's browser contexts) or its instance limit (``max_instances``), the smaller; None when it sets
    no bound."""
    try:
        with env_http(url.rstrip("/"), token=token, timeout=timeout) as http:
            health = _check(http.get("/health"))
    except httpx.TransportError as err:
        raise _transport_error("GET", "/health", url, err) from err
    return health_capacity(health)


def health_capacity(health: Any) -> int | None:
    """The live instances a server holds at once, from its /health answer (see :func:`server_capacity`)."""
    if not isinstance(health, dict):
        return None
    bounds = [int(health[k]) for k in ("capacity", "max_instances") if health.get(k)]
    return min(bounds) if bounds else None


def agentgym_conversation(instruction: str, ack: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """AgentGym's ``conversation_start``: the instruction (human) and the agent's acknowledgement (gpt)."""
    return ({"from": "human", "loss": None, "value": instruction}, {"from": "gpt", "loss": False, "value": ack})


class ClientLogic:
    """What sync and async clients share: prompts, parsing and turning payloads into outputs."""

    env_name: ClassVar[str] = ""
    conversation_start: ClassVar[tuple[dict[str, Any], dict[str, Any]]] = ()  # type: ignore[assignment]

    id: int
    _last: StepOutput

    def parse(self, reply: str) -> str:
        """The action to send for a model reply; raises ActionParseError with the message to show."""
        return self.clean_action(parse_react(reply))

    def clean_action(self, action: str) -> str:
        """Environment-specific normalisation of a parsed action."""
        return action

    def format_reset(self, payload: dict[str, Any]) -> str:
        """The first observation the agent sees, from the /reset payload."""
        return str(payload["observation"])

    def _output(self, payload: dict[str, Any], observation: str | None = None) -> StepOutput:
        known = {"id", "observation", "reward", "score", "done", "success", "info"}
        info = dict(payload.get("info") or {})
        info.update({k: v for k, v in payload.items() if k not in known})
        self._last = StepOutput(
            observation=observation if observation is not None else str(payload["observation"]),
            reward=float(payload.get("reward", 0.0)),
            score=float(payload.get("score", 0.0)),
            done=bool(payload.get("done", False)),
            success=bool(payload.get("success", False)),
            info=info,
        )
        return self._last

    def _rejected(self, err: ActionParseError) -> StepOutput:
        last = getattr(self, "_last", StepOutput(""))
        return StepOutput(str(err), last.reward, last.score, False, last.success, {}, sent=False)

    def _prepare(self, reply: str) -> str | StepOutput:
        try:
            return self.parse(reply)
        except ActionParseError as err:
            return self._rejected(err)


class BaseEnvClient(ClientLogic):
    """Synchronous client for one environment instance."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 120.0,
        http: httpx.Client | None = None,
    ) -> None:
        self.http = http or env_http(base_url, token=token, timeout=timeout)
        self._owns_http = http is None
        self.id = int(self._post("/create", {})["id"])

    @classmethod
    def attach(cls, http: httpx.Client, instance_id: int) -> BaseEnvClient:
        """A client for an instance that already exists on ``http``'s server (opened by :func:`open_many`)."""
        self = cls.__new__(cls)
        self.http, self._owns_http, self.id = http, False, instance_id
        return self

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return _post_json(self.http, path, body)

    def _get(self, path: str) -> Any:
        try:
            return _check(self.http.get(path, params={"id": self.id}))
        except httpx.TransportError as err:
            raise _transport_error("GET", path, self.http.base_url, err) from err

    def reset(self, data_idx: int) -> StepOutput:
        payload = self._post("/reset", {"id": self.id, "data_idx": data_idx})
        return self._output(payload, self.format_reset(payload))

    def step(self, reply: str) -> StepOutput:
        action = self._prepare(reply)
        if isinstance(action, StepOutput):
            return action
        return self._output(self._post("/step", {"id": self.id, "action": action}))

    def observe(self) -> str:
        payload = self._get("/observation")
        return str(payload["observation"] if isinstance(payload, dict) else payload)

    def available_actions(self) -> list[str]:
        return list(self._get("/available_actions")["available_actions"])

    def close(self) -> None:
        try:
            self._post("/close", {"id": self.id})
        finally:
            if self._owns_http:
                self.http.close()

    def __enter__(self) -> BaseEnvClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBaseEnvClient(ClientLogic):
    """Asynchronous client for one environment instance: ``client = await XClient.create(url)``."""

    http: httpx.AsyncClient
    _owns_http: bool

    @classmethod
    async def create(
        cls,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 120.0,
        http: httpx.AsyncClient | None = None,
    ) -> AsyncBaseEnvClient:
        self = cls()
        self.http = http or async_env_http(base_url, token=token, timeout=timeout)
        self._owns_http = http is None
        self.id = int((await self._post("/create", {}))["id"])
        return self

    @classmethod
    def attach(cls, http: httpx.AsyncClient, instance_id: int) -> AsyncBaseEnvClient:
        """:meth:`BaseEnvClient.attach` for asyncio."""
        self = cls()
        self.http, self._owns_http, self.id = http, False, instance_id
        return self

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await _apost_json(self.http, path, body)

    async def _get(self, path: str) -> Any:
        try:
            return _check(await self.http.get(path, params={"id": self.id}))
        except httpx.TransportError as err:
            raise _transport_error("GET", path, self.http.base_url, err) from err

    async def reset(self, data_idx: int) -> StepOutput:
        payload = await self._post("/reset", {"id": self.id, "data_idx": data_idx})
        return self._output(payload, self.format_reset(payload))

    async def step(self, reply: str) -> StepOutput:
        action = self._prepare(reply)
        if isinstance(action, StepOutput):
            return action
        return self._output(await self._post("/step", {"id": self.id, "action": action}))

    async def observe(self) -> str:
        payload = await self._get("/observation")
        return str(payload["observation"] if isinstance(payload, dict) else payload)

    async def available_actions(self) -> list[str]:
        return list((await self._get("/available_actions"))["available_actions"])

    async def close(self) -> None:
        try:
            await self._post("/close", {"id": self.id})
        finally:
            if self._owns_http:
                await self.http.aclose()


def _batch_plan(clients: Sequence[ClientLogic], replies: Sequence[str]) -> tuple[list[Any], list[dict]]:
    if len(clients) != len(replies):
        raise ValueError(f"step_many got {len(clients)} clients but {len(replies)} replies")
    prepared = [c._prepare(r) for c, r in zip(clients, replies, strict=True)]
    steps = [{"id": c.id, "action": a} for c, a in zip(clients, prepared, strict=True) if isinstance(a, str)]
    return prepared, steps


def _batch_outputs(clients: Sequence[ClientLogic], prepared: list[Any], results: list[dict | None],
                   errors: dict[str, str]) -> list[StepOutput]:
    it = iter(results)
    outputs = []
    for client, action in zip(clients, prepared, strict=True):
        if isinstance(action, StepOutput):
            outputs.append(action)
            continue
        result = next(it)
        if result is None:
            outputs.append(StepOutput("", error=errors.get(str(client.id), "environment error")))
        else:
            outputs.append(client._output(result))
    return outputs


def _partial(err: EnvServerError, partial: bool) -> tuple[list[dict | None], dict[str, str]]:
    if not partial or not isinstance(err.payload, dict) or "results" not in err.payload:
        raise err
    return err.payload["results"], err.payload.get("errors", {})


def step_many(clients: Sequence[BaseEnvClient], replies: Sequence[str], *, partial: bool = False) -> list[StepOutput]:
    """Step many instances of one server in one ``POST /step_batch`` request (a rollout round).

    With ``partial=True``, instances whose simulator failed come back with ``StepOutput.error`` set
    instead of failing the whole round (the server still stepped the others).
    """
    prepared, steps = _batch_plan(clients, replies)
    results: list[dict | None] = []
    errors: dict[str, str] = {}
    if steps:
        try:
            results = clients[0]._post("/step_batch", {"steps": steps})["results"]
        except EnvServerError as err:
            results, errors = _partial(err, partial)
    return _batch_outputs(clients, prepared, results, errors)


async def astep_many(
    clients: Sequence[AsyncBaseEnvClient], replies: Sequence[str], *, partial: bool = False
) -> list[StepOutput]:
    """Async form of :func:`step_many`."""
    prepared, steps = _batch_plan(clients, replies)
    results: list[dict | None] = []
    errors: dict[str, str] = {}
    if steps:
        try:
            results = (await clients[0]._post("/step_batch", {"steps": steps}))["results"]
        except EnvServerError as err:
            results, errors = _partial(err, partial)
    return _batch_outputs(clients, prepared, results, errors)


#: What :func:`open_many` gives for each item: the instance's client and its first observation, or the error that
#: kept that one instance from opening (``retryable`` when the server was full).
Opened = tuple[ClientLogic, StepOutput] | EnvServerError


def _post_json(http: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    try:
        return _check(http.post(path, json=body))
    except httpx.TransportError as err:
        raise _transport_error("POST", path, http.base_url, err) from err


async def _apost_json(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    try:
        return _check(await http.post(path, json=body))
    except httpx.TransportError as err:
        raise _transport_error("POST", path, http.base_url, err) from err


def _opened_payload(err: EnvServerError) -> tuple[list[dict | None], dict[str, Any]]:
    if not isinstance(err.payload, dict) or not isinstance(err.payload.get("results"), list):
        raise err  # the request as a whole failed (unreachable, bad data_idx, no such endpoint): nothing was opened
    return err.payload["results"], err.payload.get("errors") or {}


def _opened(cls: Any, http: Any, results: list[dict | None], errors: dict[str, Any]) -> list[Opened]:
    out: list[Opened] = []
    for pos, payload in enumerate(results):
        if payload is None:
            error = errors.get(str(pos)) or {}
            out.append(EnvServerError(f"POST /create_batch item {pos} -> HTTP {error.get('status')}: "
                                      f"{error.get('detail', 'environment error')}", error.get("status")))
            continue
        client = cls.attach(http, int(payload["id"]))
        out.append((client, client._output(payload, client.format_reset(payload))))
    return out


def open_many(cls: type[BaseEnvClient], http: httpx.Client, data_idxs: Sequence[int]) -> list[Opened]:
    """Open and reset one instance of ``cls``'s environment per ``data_idx`` in one ``POST /create_batch``.

    Each item succeeds or fails on its own (see :data:`Opened`). Raises :class:`EnvServerError` when the request as
    a whole failed: the server is unreachable, a ``data_idx`` is out of range (422, nothing opened), or the server
    has no such endpoint (404/405, an AgentGym server: open them one by one with ``cls(url)`` then).
    """
    try:
        payload = _post_json(http, "/create_batch", {"data_idx": list(data_idxs)})
        results, errors = payload["results"], {}
    except EnvServerError as err:
        results, errors = _opened_payload(err)
    return _opened(cls, http, results, errors)


async def aopen_many(cls: type[AsyncBaseEnvClient], http: httpx.AsyncClient, data_idxs: Sequence[int]
                     ) -> list[Opened]:
    """Async form of :func:`open_many`."""
    try:
        payload = await _apost_json(http, "/create_batch", {"data_idx": list(data_idxs)})
        results, errors = payload["results"], {}
    except EnvServerError as err:
        results, errors = _opened_payload(err)
    return _opened(cls, http, results, errors)


def close_many(clients: Sequence[BaseEnvClient]) -> list[int]:
    """Close instances of one server in one ``POST /close_batch``; returns the ids that were already gone (closed
    or reaped). A client that owns its HTTP session closes it too."""
    if not clients:
        return []
    try:
        return list(_post_json(clients[0].http, "/close_batch", {"ids": [c.id for c in clients]})["missing"])
    finally:
        for c in clients:
            if c._owns_http:
                c.http.close()


async def aclose_many(clients: Sequence[AsyncBaseEnvClient]) -> list[int]:
    """Async form of :func:`close_many`."""
    if not clients:
        return []
    try:
        return list((await _apost_json(clients[0].http, "/close_batch", {"ids": [c.id for c in clients]}))["missing"])
    finally:
        for c in clients:
            if c._owns_http:
                await c.http.aclose()
