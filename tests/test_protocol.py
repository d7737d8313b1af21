"""Protocol conformance of every served environment through real HTTP on localhost.

AgentGym's field names, real error statuses for every kind of bad request, batch stepping, auth,
limits and the idle reaper.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from envs.client import EnvServerError
from envs.launcher import running_server
from envs.registry import client_class, expert

ENVS = ["babyai", "textcraft", "sciworld", "deepsearch", "webarena"]
OUT_OF_RANGE = {"babyai": -1, "textcraft": 544, "sciworld": 10**6, "deepsearch": 2800, "webarena": 33}
FIELDS = {
    "babyai": {"observation", "reward", "score", "deleted", "done"},
    "textcraft": {"id", "observation", "done", "reward"},
    "sciworld": {"task_name", "var_num", "task_description", "observation", "reward", "score", "deleted", "done"},
    "deepsearch": {"observation", "reward", "done"},
    "webarena": {"observation", "reward", "done", "sites", "object"},
}


@pytest.fixture(params=ENVS)
def env(request: pytest.FixtureRequest) -> str:
    if request.param == "sciworld":
        request.applymarker(pytest.mark.jvm)
    if request.param == "webarena":
        request.applymarker(pytest.mark.browser)
    return request.param


@pytest.fixture
def http(env: str, env_server) -> httpx.Client:
    with httpx.Client(base_url=env_server(env), timeout=120.0) as client:
        yield client


def _new(http: httpx.Client, data_idx: int = 1) -> int:
    created = http.post("/create")  # AgentGym clients send no body and no content type
    assert created.status_code == 200, created.text
    idx = created.json()["id"]
    assert http.post("/reset", json={"id": idx, "data_idx": data_idx}).status_code == 200
    return idx


def test_wire_fields_match_agentgym(env: str, http: httpx.Client) -> None:
    idx = http.post("/create").json()["id"]
    reset = http.post("/reset", json={"id": idx, "data_idx": 1})
    assert reset.status_code == 200
    body = reset.json()
    assert FIELDS[env] <= set(body), f"missing {FIELDS[env] - set(body)}"
    assert body["done"] is False and body["reward"] == 0.0 and isinstance(body["observation"], str)
    actions = http.get("/available_actions", params={"id": idx})
    assert actions.status_code == 200 and actions.json()["available_actions"]
    step = http.post("/step", json={"id": idx, "action": "inventory" if env != "babyai" else "turn left"})
    assert step.status_code == 200
    assert {"observation", "reward", "score", "done"} <= set(step.json())
    assert 0.0 <= step.json()["reward"] <= 1.0
    obs = http.get("/observation", params={"id": idx})
    assert obs.status_code == 200 and obs.json()["observation"] == step.json()["observation"]
    assert http.post("/close", json={"id": idx}).json() is True


def test_textcraft_create_answers_with_a_reset_episode_like_agentgym(env_server) -> None:
    with httpx.Client(base_url=env_server("textcraft")) as http:
        created = http.post("/create", json={"commands": None, "goal": None, "minecraft_dir": "ignored/"}).json()
        assert {"id", "observation", "done", "reward"} <= set(created)
        assert created["observation"].startswith("Crafting commands:") and created["done"] is False
        step = http.post("/step", json={"id": created["id"], "action": "inventory"})
        assert step.status_code == 200
        http.post("/close", json={"id": created["id"]})


def test_unknown_id_is_404_everywhere(http: httpx.Client) -> None:
    missing = 10**9
    for response in (
        http.post("/reset", json={"id": missing, "data_idx": 0}),
        http.post("/step", json={"id": missing, "action": "look"}),
        http.post("/step_batch", json={"steps": [{"id": missing, "action": "look"}]}),
        http.get("/observation", params={"id": missing}),
        http.get("/available_actions", params={"id": missing}),
        http.post("/close", json={"id": missing}),
    ):
        assert response.status_code == 404, response.request.url
        assert str(missing) in response.json()["detail"]


def test_closed_id_is_404_and_ids_are_never_reused(http: httpx.Client) -> None:
    first = _new(http)
    assert http.post("/close", json={"id": first}).status_code == 200
    assert http.post("/step", json={"id": first, "action": "x"}).status_code == 404
    assert http.post("/close", json={"id": first}).status_code == 404
    second = http.post("/create").json()["id"]
    assert second > first
    http.post("/close", json={"id": second})


@pytest.mark.parametrize(
    "body",
    [b"\x00\xff\xfe garbage", b"{}", b'{"id": "one", "action": "x"}', b'{"id": 0}', b'{"id": 0, "action": 7}',
     b"[1, 2, 3]", b'{"id": -3, "action": "x"}'],
)
def test_malformed_step_body_is_422(http: httpx.Client, body: bytes) -> None:
    response = http.post("/step", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["detail"]


def test_data_idx_out_of_range_is_422_naming_the_range(env: str, http: httpx.Client) -> None:
    idx = http.post("/create").json()["id"]
    response = http.post("/reset", json={"id": idx, "data_idx": OUT_OF_RANGE[env]})
    assert response.status_code == 422
    assert "data_idx" in response.json()["detail"] and "valid" in response.json()["detail"]
    http.post("/close", json={"id": idx})


def test_step_before_reset_and_after_done_is_409(env: str, http: httpx.Client, env_server) -> None:
    idx = http.post("/create").json()["id"]
    before_reset = http.post("/step", json={"id": idx, "action": "inventory"})
    assert before_reset.status_code == (200 if env == "textcraft" else 409)  # TextCraft resets on /create
    http.post("/close", json={"id": idx})
    client = client_class(env)(env_server(env))
    final = expert(env)(client, 1)
    assert final.done
    again = client.http.post("/step", json={"id": client.id, "action": "inventory"})
    assert again.status_code == 409 and "finished" in again.json()["detail"]
    batch = client.http.post("/step_batch", json={"steps": [{"id": client.id, "action": "inventory"}]})
    assert batch.status_code == 409
    client.close()


def test_action_over_1mb_is_413(http: httpx.Client) -> None:
    idx = _new(http)
    response = http.post("/step", json={"id": idx, "action": "a" * (1 << 20) + "b"})
    assert response.status_code == 413 and "limit" in response.json()["detail"]
    assert http.post("/step", json={"id": idx, "action": "inventory"}).status_code == 200
    http.post("/close", json={"id": idx})


def test_batch_step_matches_single_steps_and_is_atomic(env: str, http: httpx.Client) -> None:
    ids = [_new(http, data_idx=i) for i in (1, 2, 3)]
    action = "turn left" if env == "babyai" else "inventory"
    batch = http.post("/step_batch", json={"steps": [{"id": i, "action": action} for i in ids]})
    assert batch.status_code == 200
    results = batch.json()["results"]
    assert [r["id"] for r in results] == ids
    for i, result in zip(ids, results, strict=True):
        assert http.get("/observation", params={"id": i}).json()["observation"] == result["observation"]
    dup = http.post("/step_batch", json={"steps": [{"id": ids[0], "action": action}] * 2})
    assert dup.status_code == 422
    before = http.get("/observation", params={"id": ids[0]}).json()["observation"]
    steps = [{"id": ids[0], "action": "turn right"}, {"id": 10**9, "action": "x"}]
    mixed = http.post("/step_batch", json={"steps": steps})
    assert mixed.status_code == 404
    assert http.get("/observation", params={"id": ids[0]}).json()["observation"] == before  # nothing stepped
    for i in ids:
        http.post("/close", json={"id": i})


def test_bad_input_never_kills_the_server(http: httpx.Client) -> None:
    rng = __import__("random").Random(0)
    for path in ("/create", "/reset", "/step", "/step_batch", "/close"):
        for _ in range(10):
            junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            response = http.post(path, content=junk, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (path, response.status_code, response.text)
    for params in ({"id": "abc"}, {}, {"id": "-1"}):
        assert 400 <= http.get("/observation", params=params).status_code < 500
    assert http.get("/health").json()["status"] == "ok"


def test_instance_limit_is_429_and_frees_on_close() -> None:
    with running_server("textcraft", max_instances=2) as url, httpx.Client(base_url=url) as http:
        ids = [http.post("/create").json()["id"] for _ in range(2)]
        full = http.post("/create")
        assert full.status_code == 429 and "limit" in full.json()["detail"]
        http.post("/close", json={"id": ids[0]})
        assert http.post("/create").status_code == 200


def test_bearer_token_guards_everything_but_health() -> None:
    with running_server("textcraft", token="s3cret") as url, httpx.Client(base_url=url) as http:
        assert http.get("/health").status_code == 200
        assert http.post("/create").status_code == 401
        wrong = http.post("/create", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "token" in wrong.json()["detail"]
        assert http.get("/observation", params={"id": 0}).status_code == 401
        client = client_class("textcraft")(url, token="s3cret")
        assert client.reset(0).observation.startswith("Crafting commands:")
        client.close()
        os.environ["SCALINGINTER_ENV_TOKEN"] = "s3cret"  # the client also reads the environment variable
        try:
            client_class("textcraft")(url).close()
        finally:
            del os.environ["SCALINGINTER_ENV_TOKEN"]


def test_idle_reaper_closes_abandoned_instances() -> None:
    with running_server("babyai", idle_ttl_s=1.0) as url, httpx.Client(base_url=url) as http:
        idx = _new(http)
        busy = _new(http)
        deadline = time.monotonic() + 60  # the reaper runs every 0.25 s: ~1.3 s quiet
        while http.get("/health").json()["reaped"] < 1:  # keep one instance in use; abandon the other
            http.get("/observation", params={"id": busy})
            assert time.monotonic() < deadline, "the idle instance was not reaped within 60 s"
            time.sleep(0.1)
        assert http.post("/step", json={"id": idx, "action": "turn left"}).status_code == 404
        assert http.post("/step", json={"id": busy, "action": "turn left"}).status_code == 200
        health = http.get("/health").json()
        assert health["reaped"] == 1 and health["instances"] == 1


def test_body_over_server_limit_is_413_before_parsing() -> None:
    with running_server("textcraft", max_body_bytes=1 << 20) as url, httpx.Client(base_url=url) as http:
        response = http.post("/step_batch", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
        assert response.status_code == 413 and "limit" in response.json()["detail"]
        assert http.get("/health").status_code == 200


@pytest.mark.jvm
def test_a_crashed_simulator_fails_only_its_own_step_in_a_batch() -> None:
    import psutil

    from envs.client import step_many

    with running_server("sciworld", max_jvms=2) as url, httpx.Client(base_url=url, timeout=120.0) as http:
        clients = [client_class("sciworld")(url, http=http) for _ in range(2)]
        for c in clients:
            c.reset(3)
        server = psutil.Process(http.get("/health").json()["pid"])
        javas = [p for p in server.children(recursive=True) if "java" in p.name()]
        assert len(javas) == 2
        javas[0].kill()
        javas[0].wait(10)
        with pytest.raises(EnvServerError) as err:
            step_many(clients, ["Action: look around"] * 2)
        assert err.value.status_code == 500 and len(err.value.payload["errors"]) == 1
        outs = step_many(clients, ["Action: look around"] * 2, partial=True)
        failed = [o for o in outs if o.error]
        assert len(failed) == 1 and next(o.observation for o in outs if not o.error)
        assert http.get("/health").json()["status"] == "ok"
        for c in clients:
            c.close()


def test_a_parallel_batch_steps_its_instances_at_the_same_time() -> None:
    """A backend with ``parallel_steps`` (SciWorld: a JVM per instance) has a /step_batch's instances stepped
    together: four steps that each wait for the other three all finish (stepped one after another, the first would
    wait in vain); results keep the request's order and a failing instance loses none of the others' steps."""
    import threading

    from envs.base import StepResult
    from envs.instances import Slot
    from envs.server import StepBody, _step_all

    together = threading.Barrier(4, timeout=10)

    class Meeting:
        def __init__(self, name: str) -> None:
            self.name = name

        def step(self, action: str) -> StepResult:
            together.wait()  # BrokenBarrierError unless all four are stepping at once
            if action == "fail":
                raise RuntimeError(f"{self.name} crashed")
            return StepResult(observation=f"{self.name}: {action}", reward=0.0, score=0.0, done=False)

    slots = {i: Slot(env=Meeting(f"instance {i}"), reset=True) for i in (7, 3, 9, 5)}
    steps = [StepBody(id=i, action="fail" if i == 9 else "look") for i in (7, 3, 9, 5)]
    results, errors = _step_all(slots, steps, parallel=True)
    assert [r and r["id"] for r in results] == [7, 3, None, 5]
    assert results[1]["observation"] == "instance 3: look" and errors == {9: "RuntimeError: instance 9 crashed"}


def test_create_batch_opens_what_create_and_reset_open_and_close_batch_closes_them(env: str, http: httpx.Client
                                                                                    ) -> None:
    live = http.get("/health").json()["instances"]
    single = {}
    for data_idx in (1, 2):
        idx = _new(http, data_idx)
        single[data_idx] = http.get("/observation", params={"id": idx}).json()["observation"]
        http.post("/close", json={"id": idx})
    opened = http.post("/create_batch", json={"data_idx": [2, 1]})
    assert opened.status_code == 200, opened.text
    results = opened.json()["results"]
    # (a SciWorld room lists its contents in an order that can differ between JVMs: compare what it lists)
    assert [sorted(r["observation"].splitlines()) for r in results] == [sorted(single[i].splitlines()) for i in (2, 1)]
    assert FIELDS[env] - {"deleted", "id"} <= set(results[0]) and len({r["id"] for r in results}) == 2
    assert http.get("/health").json()["instances"] == live + 2
    ids = [r["id"] for r in results]
    stepped = http.post("/step", json={"id": ids[0], "action": "turn left" if env == "babyai" else "inventory"})
    assert stepped.status_code == 200  # opened instances are reset: they take steps
    bad = http.post("/create_batch", json={"data_idx": [1, OUT_OF_RANGE[env]]})
    assert bad.status_code == 422 and "out of range" in bad.json()["detail"]
    assert http.get("/health").json()["instances"] == live + 2  # nothing of a refused request was opened
    closed = http.post("/close_batch", json={"ids": [*ids, 10**9]})
    assert closed.status_code == 200 and closed.json() == {"closed": ids, "missing": [10**9]}
    assert http.get("/health").json()["instances"] == live
    assert http.post("/step", json={"id": ids[0], "action": "x"}).status_code == 404
    for body in ({}, {"data_idx": []}, {"data_idx": ["1"]}, {"data_idx": 1}):
        assert http.post("/create_batch", json=body).status_code == 422, body
    assert http.post("/close_batch", json={"ids": [-1]}).status_code == 422


def test_create_batch_over_the_limit_opens_what_fits_and_leaks_nothing() -> None:
    from envs.client import close_many, open_many

    with running_server("babyai", max_instances=3) as url, httpx.Client(base_url=url) as http:
        full = http.post("/create_batch", json={"data_idx": [0, 1, 2, 3, 4]})
        assert full.status_code == 429  # every failed item found the server full: retry later
        body = full.json()
        assert [r is None for r in body["results"]] == [False, False, False, True, True]
        assert set(body["errors"]) == {"3", "4"} and body["errors"]["3"]["status"] == 429
        assert "instance limit" in body["detail"] and http.get("/health").json()["instances"] == 3
        http.post("/close_batch", json={"ids": [r["id"] for r in body["results"] if r]})

        opened = open_many(client_class("babyai"), http, [5, 6, 7, 8])
        errors = [o for o in opened if isinstance(o, EnvServerError)]
        assert len(errors) == 1 and errors[0].retryable and errors[0].status_code == 429
        clients = [o[0] for o in opened if not isinstance(o, EnvServerError)]
        assert clients[0].step("Action: turn left").observation  # an attached client steps its instance
        assert close_many(clients) == [] and http.get("/health").json()["instances"] == 0
        assert close_many(clients) == [c.id for c in clients]  # already gone: listed, not an error
        with client_class("babyai")(url, http=http) as one:
            assert one.reset(5).observation == opened[0][1].observation  # as the client formats a reset


def test_a_reset_that_fails_in_create_batch_leaves_no_instance_behind() -> None:
    """One item's simulator fails to reset: that item is a 500 with its message, the others are opened, and the
    failed one's instance is not left behind."""
    from envs.registry import load_backend
    from envs.server import create_app
    from tests.conftest import serving

    backend = load_backend("babyai")
    make = backend.new_instance

    def new_instance():
        env = make()
        reset = env.reset

        def failing(data_idx: int):
            if data_idx == 13:
                raise RuntimeError("simulator crashed on 13")
            return reset(data_idx)

        env.reset = failing
        return env

    backend.new_instance = new_instance
    with serving(create_app(backend)) as url, httpx.Client(base_url=url) as http:
        response = http.post("/create_batch", json={"data_idx": [12, 13, 14]})
        assert response.status_code == 500
        body = response.json()
        assert body["errors"] == {"1": {"status": 500, "detail": "RuntimeError: simulator crashed on 13"}}
        assert body["results"][1] is None and all(body["results"][i] for i in (0, 2))
        assert http.get("/health").json()["instances"] == 2
        assert http.post("/close_batch", json={"ids": [body["results"][i]["id"] for i in (0, 2)]}).status_code == 200
        assert http.get("/health").json()["instances"] == 0


def test_a_server_whose_port_another_process_took_is_started_again_on_its_own(monkeypatch) -> None:
    # the race that made two tests of this module talk to each other's servers: free_port() gave a port that another
    # process bound first; the new server failed to bind it, and the other server's /health answered for it
    from fastapi import FastAPI

    import envs.launcher as launcher
    from tests.conftest import serving

    squatter = FastAPI()
    squatter.get("/health")(lambda: {"env": "not yours", "pid": os.getpid()})
    real_free_port = launcher.free_port
    with serving(squatter) as taken:
        port = httpx.URL(taken).port
        given = iter([port, port])  # the first two servers are given the squatter's port
        monkeypatch.setattr(launcher, "free_port", lambda: next(given, None) or real_free_port())
        with running_server("textcraft") as url, httpx.Client(base_url=url) as http:
            health = http.get("/health").json()
            assert url != taken and health["env"] == "textcraft" and health["pid"] != os.getpid()
        given = iter([port] * 5)
        with pytest.raises(launcher.PortTaken, match=rf"port {port} .*another process"):
            launcher.start_server("textcraft")
        assert httpx.get(f"{taken}/health").json()["env"] == "not yours"  # the squatter was left alone


def test_a_port_another_process_answered_on_then_closed_is_still_taken_not_a_crash() -> None:
    # the race of a full CI run: a WebArena egress proxy (port 0, opened and closed with each browser context) held
    # the port a new server was given; the server exited on "address already in use" after the proxy had answered
    # its /health polls with 403 and closed. Nobody listened any more, but the port had been another's: the
    # launcher must start the server again on another port, not fail the run
    import socket
    import subprocess
    import sys
    import threading

    import envs.launcher as launcher

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def squat() -> None:
        for _ in range(3):  # answer three polls, then close like a proxy whose browser context closed
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        listener.close()

    thread = threading.Thread(target=squat, daemon=True)
    thread.start()
    # the server that could not bind: it exits with uvicorn's startup-failure code once the squatter is gone
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.5); sys.exit(3)"])
    try:
        with pytest.raises(launcher.PortTaken, match=rf"port {port} .*another process"):
            launcher.wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=30)
    finally:
        proc.kill()
        proc.wait()
        thread.join(5)
    assert not launcher._someone_listens(port)  # nobody listened when the server exited: only the answers tell
