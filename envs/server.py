"""One FastAPI app factory that serves any environment backend over AgentGym's wire protocol.

Endpoints (AgentGym's names and fields, so existing clients work unchanged):
``POST /create``, ``POST /reset {id, data_idx}``, ``POST /step {id, action}``, ``GET /observation?id=``,
``POST /close {id}``; plus ``GET /available_actions?id=``, ``GET /health``, ``POST /step_batch
{steps: [{id, action}, ...]}`` which steps a whole rollout round in one request, ``POST /create_batch
{data_idx: [...]}`` which opens and resets a whole rollout's instances in one, and ``POST /close_batch {ids:
[...]}`` which closes them.

Errors are real statuses with ``{"detail": "<what is wrong>"}``: unknown id 404, malformed body 422,
data_idx out of range 422, stepping a finished episode 409, instance limit 429, a full simulator pool
503, an action over 1 MB 413, a missing or wrong bearer token 401. Never HTTP 200 with an error inside.

    python -m envs.server babyai --port 8000          # or: scalinginter serve babyai --port 8000
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from envs.base import Backend, EnvError, EpisodeFinishedError, StepResult
from envs.client import TOKEN_ENV_VAR
from envs.instances import IDLE_TTL_S, MAX_INSTANCES, InstanceTable, NotResetError, Slot, UnknownInstanceError
from envs.requests import (
    MAX_ACTION_BYTES,
    ActionTooLargeError,
    BatchBody,
    CloseBatchBody,
    CreateBatchBody,
    IdBody,
    RequestShapeError,
    ResetBody,
    StepBody,
    check_action,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def _step(slot: Slot, idx: int, action: str) -> StepResult:
    if not slot.reset:
        raise NotResetError(f"instance {idx} has no task yet: POST /reset {{id, data_idx}} first")
    if slot.done:
        raise EpisodeFinishedError(f"instance {idx}'s episode is finished: reset it or close it")
    result = slot.env.step(action)
    slot.done = result.done
    return result


#: threads a parallel ``/step_batch`` (or ``/create_batch``) works its instances on
STEP_THREADS = 16


def _each(fn: Callable[[T], dict], items: Sequence[T], parallel: bool = False
          ) -> tuple[list[dict | None], dict[int, Exception]]:
    """``fn`` on every item (at the same time when ``parallel``); an item whose call raises gets None and its error
    (by position), the rest go on. Results keep the items' order."""
    errors: dict[int, Exception] = {}

    def one(pos: int) -> dict | None:
        try:
            return fn(items[pos])
        except Exception as exc:  # one crashed simulator must not lose the others' work
            errors[pos] = exc
            return None

    if parallel and len(items) > 1:
        with ThreadPoolExecutor(max_workers=min(len(items), STEP_THREADS), thread_name_prefix="batch") as pool:
            return list(pool.map(one, range(len(items)))), errors
    return [one(pos) for pos in range(len(items))], errors


def _step_all(slots: dict[int, Slot], steps: list[StepBody], parallel: bool = False
              ) -> tuple[list[dict | None], dict[int, str]]:
    """Step every instance (at the same time when ``parallel``); an instance whose simulator raises gets None and
    an error, the rest go on. Results keep the request's order."""
    results, failed = _each(lambda s: {"id": s.id, **_step(slots[s.id], s.id, s.action).to_wire()}, steps, parallel)
    errors = {}
    for pos, exc in failed.items():
        log.error("instance %d failed to step", steps[pos].id, exc_info=exc)
        errors[steps[pos].id] = f"{type(exc).__name__}: {exc}"
    return results, errors


def _on_loop(handler: Any) -> Any:
    """An async endpoint that calls the sync ``handler`` directly on the event loop."""

    @functools.wraps(handler)
    async def endpoint(body: Any) -> JSONResponse:
        return handler(body)

    return endpoint  # functools.wraps exposes the handler's signature, so FastAPI parses the same body


class BodyTooLargeError(EnvError):
    status_code = 413


class Gate:
    """ASGI middleware in front of every endpoint, before any body is read:

    * the bearer token (when set) on every path but ``/health`` (the OpenAPI docs included);
    * the body limit, on the declared ``Content-Length`` and on the bytes actually streamed (chunked bodies);
    * an error no handler knew becomes a JSON answer (500; 422 for JSON nested too deeply) on a connection
      that stays open: Starlette's own last-resort handler re-raises, and uvicorn then drops the keep-alive
      connection, so a client's next request on it, another instance's step, would fail.
    """

    def __init__(self, app: Any, limit: int, token: str | None, name: str) -> None:
        self.app, self.limit, self.token, self.name = app, limit, token, name

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.token is not None and scope["path"] != "/health" and not secrets.compare_digest(
                headers.get(b"authorization", b""), f"Bearer {self.token}".encode()):
            detail = "missing or wrong bearer token: send 'Authorization: Bearer <token>'"
            return await JSONResponse({"detail": detail}, 401, headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            detail = f"request body is {int(length)} bytes; the limit is {self.limit} bytes"
            return await JSONResponse({"detail": detail}, 413)(scope, receive, send)
        received, started = 0, False

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise BodyTooLargeError(f"request body is over {self.limit} bytes (streamed); the limit is "
                                        f"{self.limit} bytes")
            return message

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, tracked)
        except Exception as exc:
            if started:
                raise
            if isinstance(exc, RecursionError):
                status, detail = 422, "malformed request: the JSON body is nested too deeply"
            else:
                log.exception("environment error on %s", scope["path"])
                status, detail = 500, f"{self.name} environment error: {type(exc).__name__}: {exc}"
            await JSONResponse({"detail": detail}, status)(scope, receive, send)


def create_app(
    backend: Backend,
    *,
    max_instances: int = MAX_INSTANCES,
    idle_ttl_s: float = IDLE_TTL_S,
    token: str | None = None,
    max_body_bytes: int = 64 << 20,
) -> FastAPI:
    """Build the HTTP app serving ``backend``. ``token`` (or env var SCALINGINTER_ENV_TOKEN) enables auth."""
    table = InstanceTable(backend, max_instances=max_instances, idle_ttl_s=idle_ttl_s)
    token = token if token is not None else os.environ.get(TOKEN_ENV_VAR) or None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        interval = min(max(idle_ttl_s / 4, 0.05), 5.0)

        def reaper() -> None:
            while not stop.wait(interval):
                table.reap()

        thread = threading.Thread(target=reaper, name="idle-reaper", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            table.close_all()
            backend.shutdown()

    app = FastAPI(title=f"scalinginter {backend.name} environment server", lifespan=lifespan)
    app.state.table = table
    app.add_middleware(Gate, limit=max_body_bytes, token=token, name=backend.name)  # auth, body limit, errors

    @app.exception_handler(EnvError)
    async def env_error(request: Request, exc: EnvError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return JSONResponse({"detail": str(exc)}, exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input back and crashes on bytes that are not UTF-8.
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        return JSONResponse({"detail": f"malformed request: {detail}", "errors": errors}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, EnvError):  # raised while FastAPI read the body (a streamed body too large)
            return JSONResponse({"detail": str(exc.__cause__)}, exc.__cause__.status_code)
        if exc.status_code == 400:  # FastAPI's "error parsing the body": a malformed body, hence 422
            return JSONResponse({"detail": f"malformed request: the body is not valid JSON ({exc.detail})"}, 422)
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)

    @app.get("/health")
    def health() -> JSONResponse:
        problem = backend.problem()
        return JSONResponse({
            "status": "ok" if problem is None else "unhealthy",
            **({"problem": problem} if problem else {}),
            "env": backend.name,
            "pid": os.getpid(),
            "instances": len(table),
            "max_instances": table.max_instances,
            "reaped": table.reaped,
            "num_items": backend.num_items,
            "capacity": backend.capacity,
        }, 200 if problem is None else 503)

    @app.post("/create")
    async def create(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if raw.strip():
            try:
                body = await request.json()
            except (ValueError, RecursionError):
                raise RequestShapeError("the /create body must be empty or a JSON object") from None
            if not isinstance(body, dict):
                raise RequestShapeError("the /create body must be empty or a JSON object")
            custom = {k: v for k, v in body.items() if k in ("commands", "goal") and v is not None}
            unsupported = sorted(set(custom) - set(backend.create_options))
            if unsupported:  # AgentGym's TextCraft takes a client's own recipes and goal; the others take none
                raise RequestShapeError(f"/create does not take {' or '.join(unsupported)} on {backend.name}: its "
                                        "tasks are its split's items, chosen by POST /reset {id, data_idx}")
            if custom:
                return create_custom(custom)
        idx = table.create()
        if not backend.reset_on_create:
            return {"id": idx, backend.id_field: idx}
        return {"id": idx, **reset(ResetBody(id=idx, data_idx=0))}

    def create_custom(options: dict[str, Any]) -> dict[str, Any]:
        """An instance running the client's own task (all of the backend's create_options, as strings)."""
        missing = [k for k in backend.create_options if k not in options]
        wrong = [k for k, v in options.items() if not isinstance(v, str) or not v.strip()]
        if missing or wrong:
            raise RequestShapeError(f"a task of your own needs {' and '.join(backend.create_options)} as non-empty "
                                    f"strings ({', '.join(missing + wrong)} missing or not a string)")
        if sum(len(v.encode()) for v in options.values()) > MAX_ACTION_BYTES:
            raise ActionTooLargeError(f"the /create task options exceed {MAX_ACTION_BYTES} bytes")
        idx = table.create()
        try:
            with table.use(idx) as slot:
                result = slot.env.reset_custom(**options)
                slot.reset, slot.done = True, result.done
        except Exception:
            table.close(idx)  # a refused task leaves no instance behind
            raise
        return {"id": idx, **result.to_wire()}

    def reset_instance(idx: int, data_idx: int) -> StepResult:
        with table.use(idx) as slot:
            result = slot.env.reset(data_idx)
            slot.reset, slot.done = True, result.done
        return result

    @app.post("/reset")
    def reset(body: ResetBody) -> dict[str, Any]:
        backend.check_index(body.data_idx)
        return {"id": body.id, **reset_instance(body.id, body.data_idx).to_wire(), "deleted": False}

    # The hot endpoints return a ready JSONResponse: it skips FastAPI's recursive encoder (a rollout's cost).
    def step_one(body: StepBody) -> JSONResponse:
        check_action(body.action)
        with table.use(body.id) as slot:
            return JSONResponse(_step(slot, body.id, body.action).to_wire())

    def step_batch(body: BatchBody) -> JSONResponse:
        ids = [s.id for s in body.steps]
        if len(set(ids)) != len(ids):
            raise RequestShapeError("step_batch got the same instance id twice; send one action per instance")
        for s in body.steps:
            check_action(s.action)
        with contextlib.ExitStack() as stack:  # all locks, in id order (no deadlock), then check, then step
            slots = {i: stack.enter_context(table.use(i)) for i in sorted(ids)}
            for i, slot in slots.items():
                if not slot.reset or slot.done:
                    _step(slot, i, "")  # raises the precise 409 before anything is stepped
            results, errors = _step_all(slots, body.steps, parallel=backend.parallel_steps)
        if errors:  # some simulators failed: 500, but the steps that did happen are not lost
            detail = f"{backend.name} environment error in instance(s) {sorted(errors)}: " + "; ".join(errors.values())
            log.error(detail)
            return JSONResponse({"detail": detail, "results": results, "errors": errors}, 500)
        return JSONResponse({"results": results})

    def open_one(data_idx: int) -> dict[str, Any]:
        idx = table.create()
        try:
            result = reset_instance(idx, data_idx)
        except Exception:
            with contextlib.suppress(UnknownInstanceError):
                table.close(idx)  # a reset that failed leaves no instance behind
            raise
        return {"id": idx, **result.to_wire()}

    def create_batch(body: CreateBatchBody) -> JSONResponse:
        """Open and reset one instance per ``data_idx``; each item's outcome is its own (one that found the server
        full, or whose simulator failed, does not undo the others)."""
        for data_idx in body.data_idx:
            backend.check_index(data_idx)  # a bad index is the caller's mistake: 422, and nothing is created
        results, failed = _each(open_one, body.data_idx, parallel=backend.parallel_steps)
        if not failed:
            return JSONResponse({"results": results})
        errors = {str(pos): {"status": exc.status_code if isinstance(exc, EnvError) else 500,
                             "detail": f"{type(exc).__name__}: {exc}"} for pos, exc in sorted(failed.items())}
        statuses = {e["status"] for e in errors.values()}
        status = statuses.pop() if len(statuses) == 1 else 500  # 429 or 503 when the server was full, so retry
        for pos, exc in failed.items():
            if not isinstance(exc, EnvError):
                log.error("data_idx %d failed to reset", body.data_idx[pos], exc_info=exc)
        detail = (f"{backend.name}: {len(failed)} of {len(body.data_idx)} instance(s) could not be opened; "
                  + "; ".join(f"item {pos}: {e['detail']}" for pos, e in errors.items()))
        return JSONResponse({"detail": detail, "results": results, "errors": errors}, status)

    def close_batch(body: CloseBatchBody) -> JSONResponse:
        """Close every id given; ids already gone (closed, reaped) are listed as ``missing``, not an error."""
        closed, missing, errors = [], [], {}
        for idx in dict.fromkeys(body.ids):
            try:
                table.close(idx)
                closed.append(idx)
            except UnknownInstanceError:
                missing.append(idx)
            except Exception as exc:  # the instance is gone from the table either way; its simulator misbehaved
                log.exception("instance %d failed to close", idx)
                errors[str(idx)] = f"{type(exc).__name__}: {exc}"
        if errors:
            return JSONResponse({"detail": f"{backend.name}: instance(s) {sorted(errors)} failed to close",
                                 "closed": closed, "missing": missing, "errors": errors}, 500)
        return JSONResponse({"closed": closed, "missing": missing})

    # Steps of fast backends (well under a millisecond) run on the event loop: a worker-thread hop costs
    # more than the step. Slow ones (a JVM, a browser) run in the thread pool so the loop stays free.
    for path, handler in (("/step", step_one), ("/step_batch", step_batch), ("/create_batch", create_batch),
                          ("/close_batch", close_batch)):
        if backend.fast_steps:
            app.post(path)(_on_loop(handler))
        else:
            app.post(path)(handler)

    @app.get("/observation")
    def observation(id: Annotated[int, Query(alias="id")] = -1, env_idx: int | None = None) -> dict[str, Any]:
        idx = _query_id(id, env_idx)
        with table.use(idx) as slot:
            return {"id": idx, "observation": slot.env.observe() if slot.reset else ""}

    @app.get("/available_actions")
    def available_actions(id: Annotated[int, Query(alias="id")] = -1, env_idx: int | None = None) -> dict[str, Any]:
        idx = _query_id(id, env_idx)
        with table.use(idx) as slot:
            if not slot.reset:
                raise NotResetError(f"instance {idx} has no task yet: POST /reset {{id, data_idx}} first")
            return {"id": idx, "available_actions": slot.env.available_actions()}

    def add_view(name: str) -> None:
        def view(id: Annotated[int, Query(alias="id")] = -1, env_idx: int | None = None) -> dict[str, Any]:
            idx = _query_id(id, env_idx)
            with table.use(idx) as slot:
                if not slot.reset:
                    raise NotResetError(f"instance {idx} has no task yet: POST /reset {{id, data_idx}} first")
                return {"id": idx, name: slot.env.view(name)}

        app.get(f"/{name}", name=name)(view)

    for name in backend.views:
        add_view(name)

    @app.post("/close")
    def close(body: IdBody) -> bool:
        table.close(body.id)
        return True

    return app


def _query_id(id: int, env_idx: int | None) -> int:
    idx = env_idx if env_idx is not None else id
    if idx < 0:
        raise RequestShapeError("query parameter 'id' (or 'env_idx') is required: ?id=<instance id>")
    return idx


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["max_jvms=2", "heap=-Xmx256m"]`` -> ``{"max_jvms": 2, "heap": "-Xmx256m"}`` (ints/floats parsed)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"backend option {pair!r} must look like key=value")
        for cast in (int, float):
            with contextlib.suppress(ValueError):
                options[key] = cast(value)
                break
        else:
            options[key] = value
    return options


# Idle keep-alive connections stay open this long on every server of the project. Clients pool connections
# and drop idle ones after their own expiry (httpx: 5 s); a server that closes first (uvicorn's default is
# also 5 s) races a client sending its next request on the same connection, which then fails with
# "connection reset by peer" (seen in the test suite under load). Outliving the clients' expiry removes
# the race: the client always closes an idle connection before the server would.
KEEP_ALIVE_S = 75


def serve(
    env: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_instances: int = MAX_INSTANCES,
    idle_ttl_s: float = IDLE_TTL_S,
    token: str | None = None,
    options: dict[str, Any] | None = None,
    log_level: str = "warning",
    max_body_bytes: int = 64 << 20,
) -> None:
    """Run the server for ``env`` with uvicorn until interrupted."""
    import uvicorn

    from envs.registry import load_backend

    app = create_app(load_backend(env, **(options or {})), max_instances=max_instances, idle_ttl_s=idle_ttl_s,
                     token=token, max_body_bytes=max_body_bytes)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, timeout_keep_alive=KEEP_ALIVE_S)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m envs.server", description=__doc__.split("\n")[0])
    parser.add_argument("env")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-instances", type=int, default=MAX_INSTANCES)
    parser.add_argument("--idle-ttl", type=float, default=IDLE_TTL_S, help="seconds before an idle instance is reaped")
    parser.add_argument("--token", default=None, help=f"bearer token (default: ${TOKEN_ENV_VAR})")
    parser.add_argument("--max-body-bytes", type=int, default=64 << 20, help="larger request bodies get 413")
    parser.add_argument("--option", action="append", default=[], help="backend option key=value (repeatable)")
    args = parser.parse_args(argv)
    serve(args.env, args.host, args.port, max_instances=args.max_instances, idle_ttl_s=args.idle_ttl,
          token=args.token, options=parse_options(args.option), max_body_bytes=args.max_body_bytes)


if __name__ == "__main__":
    main()
