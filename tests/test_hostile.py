"""Hostile input against the environment servers (issue 17, items 1-5, 7, 8), through real HTTP: lone surrogates,
deeply nested JSON, huge counts, quadratic parsing, streamed bodies over the limit, the docs behind the token,
and an unexpected error that keeps the connection open."""

from __future__ import annotations

import contextlib
import json
import re
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.deepsearch.backend import first_tag
from envs.launcher import running_server
from envs.webarena.browser import bracketed


@pytest.fixture(scope="module")
def own_server():
    """``own_server(env)``: servers of this module only. Hostile requests leave instances open (a fuzzed
    /create is never closed), which must not reach the servers other tests share and count."""
    import contextlib

    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}

        def get(env: str) -> str:
            if env not in urls:
                urls[env] = stack.enter_context(running_server(env))
            return urls[env]

        yield get


def _new(http: httpx.Client, data_idx: int = 1) -> int:
    idx = http.post("/create").json()["id"]
    assert http.post("/reset", json={"id": idx, "data_idx": data_idx}).status_code == 200
    return idx


@pytest.mark.parametrize("env", ["babyai", "textcraft", "deepsearch"])
def test_a_lone_surrogate_is_422_and_leaves_the_instance_usable(env: str, own_server) -> None:
    with httpx.Client(base_url=own_server(env), timeout=60) as http:
        idx, other = _new(http), _new(http)
        for body in (b'{"id": %d, "action": "\\ud800"}' % idx, b'{"id": %d, "action": "\xed\xa0\x80"}' % idx):
            answer = http.post("/step", content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 422, answer.text
        batch = http.post("/step_batch", json={"steps": [{"id": other, "action": "look"}]},
                          headers={"content-type": "application/json"})
        assert batch.status_code == 200  # a clean round still steps
        bad = b'{"steps": [{"id": %d, "action": "look"}, {"id": %d, "action": "\\udfff"}]}' % (other, idx)
        assert http.post("/step_batch", content=bad, headers={"content-type": "application/json"}).status_code == 422
        assert http.get("/observation", params={"id": idx}).status_code == 200  # nothing was applied


@pytest.mark.parametrize("path", ["/create", "/step", "/reset", "/step_batch"])
def test_deeply_nested_json_is_422_not_500(path: str, own_server) -> None:
    with httpx.Client(base_url=own_server("babyai"), timeout=60) as http:
        answer = http.post(path, content=b"[" * 100_000, headers={"content-type": "application/json"})
        assert answer.status_code == 422, answer.text
        assert http.get("/health").status_code == 200


def test_a_textcraft_count_of_thousands_of_digits_is_a_format_message(own_server) -> None:
    with httpx.Client(base_url=own_server("textcraft"), timeout=60) as http:
        idx = _new(http, 0)
        answer = http.post("/step", json={"id": idx, "action": f"get {'1' * 4400} oak log"})
        assert answer.status_code == 200 and "Wrong item format" in answer.json()["observation"]


def test_deep_search_tags_without_an_end_are_parsed_in_one_pass(own_server) -> None:
    with httpx.Client(base_url=own_server("deepsearch"), timeout=120) as http:
        idx = _new(http, 0)
        answer = http.post("/step", json={"id": idx, "action": "<answer>" * 120_000})  # ~1 MB: hours, quadratic
        assert answer.status_code == 200 and "Invalid action" in answer.json()["observation"]
        assert http.get("/health").status_code == 200


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="<>/answerch[]x ", max_size=40))
def test_the_linear_parsers_find_what_the_regexes_found(text: str) -> None:
    for tag in ("answer", "search"):
        match = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
        assert first_tag(text, tag) == (match and (match.start(), match.group(1)))
    assert bracketed(text) == re.findall(r"\[(.*?)\]", text, re.DOTALL)


def test_a_streamed_body_over_the_limit_is_413_and_the_token_comes_first() -> None:
    def chunks(total: int):  # no Content-Length: chunked transfer encoding
        for _ in range(total // 1000):
            yield b"x" * 1000

    with running_server("textcraft", max_body_bytes=10_000) as url, httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/step", content=chunks(50_000), headers={"content-type": "application/json"})
        assert answer.status_code == 413 and "streamed" in answer.json()["detail"]
        assert http.get("/health").status_code == 200
    with running_server("textcraft", max_body_bytes=10_000, token="s3cret") as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/create", content=chunks(50_000)).status_code == 401  # refused before reading it
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 401, path
        assert http.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert http.get("/health").status_code == 200


def test_an_unexpected_error_is_a_json_500_that_does_not_escape_to_the_server() -> None:
    """uvicorn drops a keep-alive connection when an exception escapes the app (Starlette's last-resort
    handler re-raises after answering): the gate answers and does not re-raise."""
    import asyncio

    from envs.server import Gate

    async def broken(scope, receive, send):
        raise RuntimeError("simulator exploded")

    async def call() -> httpx.Response:
        app = Gate(broken, limit=1000, token=None, name="toy")
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)  # an escaping error would raise here
        async with httpx.AsyncClient(transport=transport, base_url="http://toy") as client:
            return await client.post("/step", json={"id": 0, "action": "x"})

    answer = asyncio.run(call())
    assert answer.status_code == 500
    assert answer.json()["detail"] == "toy environment error: RuntimeError: simulator exploded"


def test_textcraft_runs_a_clients_own_task_and_answers_agentgyms_extra_endpoints(own_server) -> None:
    """AgentGym's TextCraft ``/create {commands, goal}``: the client's recipe lines are shown, its goal is checked
    and played to success; ``/commands``, ``/goal`` and ``/detail`` answer; a goal that is no craftable item is a
    422 naming it and leaves no instance; environments without task options say so."""
    with httpx.Client(base_url=own_server("textcraft"), timeout=60) as http:
        live = http.get("/health").json()["instances"]
        created = http.post("/create", json={"commands": "craft 4 stick using 2 planks\n", "goal": "minecraft:stick",
                                             "minecraft_dir": "ignored/"})
        assert created.status_code == 200, created.text
        idx = created.json()["id"]
        assert created.json()["observation"] == "Crafting commands:\ncraft 4 stick using 2 planks\n\nGoal: craft stick."
        assert http.get("/commands", params={"id": idx}).json()["commands"] == "craft 4 stick using 2 planks"
        assert http.get("/goal", params={"id": idx}).json()["goal"] == "stick"
        for action in ("get 1 oak logs", "craft 4 oak planks using 1 oak logs"):
            assert http.post("/step", json={"id": idx, "action": action}).json()["done"] is False
        last = http.post("/step", json={"id": idx, "action": "craft 4 stick using 2 oak planks"}).json()
        assert last["done"] is True and last["reward"] == 1.0
        detail = http.get("/detail", params={"id": idx}).json()["detail"]
        assert detail["success"] is True and detail["inventory"] == {"oak planks": 2, "stick": 4}
        http.post("/close", json={"id": idx})
        refused = http.post("/create", json={"commands": "craft 1 x using 1 y", "goal": "a flying carpet"})
        assert refused.status_code == 422 and "'a flying carpet' is not a craftable item" in refused.json()["detail"]
        half = http.post("/create", json={"goal": "stick"})
        assert half.status_code == 422 and "commands" in half.json()["detail"]
        assert http.get("/health").json()["instances"] == live  # the refused tasks left nothing behind
        plain = http.post("/create", json={"commands": None, "goal": None, "minecraft_dir": "crafting_recipes/"})
        assert plain.status_code == 200  # what AgentGym's client sends by default still works
        http.post("/close", json={"id": plain.json()["id"]})
    with httpx.Client(base_url=own_server("babyai"), timeout=60) as http:
        refused = http.post("/create", json={"commands": "x", "goal": "y"})
        assert refused.status_code == 422 and "does not take commands or goal on babyai" in refused.json()["detail"]
        assert http.get("/detail", params={"id": 0}).status_code == 404  # BabyAI has no such view


@pytest.mark.browser
def test_the_browser_reaches_only_the_environments_sites(own_server, env_server) -> None:
    """WebArena in real Chromium: goto refuses file://, other localhost ports and other hosts; and the context's
    route filter refuses any other request a page makes (scripts, links, forms), not only goto."""
    other = own_server("babyai")  # another server on this machine, which the agent must not reach
    with httpx.Client(base_url=env_server("webarena"), timeout=120) as http:  # closes what it opens
        idx = http.post("/create").json()["env_idx"]
        assert http.post("/reset", json={"env_idx": idx, "idx": 0}).status_code == 200
        for url in ("file:///etc/passwd", f"{other}/health", "http://169.254.169.254/latest/meta-data/"):
            seen = http.post("/step", json={"env_idx": idx, "action": f"goto [{url}]"}).json()["observation"]
            assert "goto is limited to this environment's sites" in seen, seen[:300]
            assert "root:" not in seen and '"status"' not in seen
        http.post("/close", json={"env_idx": idx})

    from envs.webarena.backend import Backend

    backend = Backend()
    try:
        import os

        import psutil

        browsers = []  # (command line, real uid) of this process's Chromium processes (renderers come and go)
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.name().startswith("chrom"):
                    browsers.append((proc.cmdline(), proc.uids().real))
        assert browsers and all("--no-sandbox" not in cmd for cmd, _ in browsers)  # Chromium's own sandbox on
        if os.geteuid() == 0:  # it refuses root: it runs as nobody
            assert {uid for _, uid in browsers} == {65534}
        env = backend.new_instance()
        env.reset(0)
        page_fetch = "url => fetch(url, {mode: 'no-cors'}).then(r => 'reached ' + r.status, e => 'refused')"
        assert backend.browser.call(lambda: env._b_page().evaluate(page_fetch, f"{other}/health")) == "refused"
        own = backend.local_sites[0] + "/shop"
        assert backend.browser.call(lambda: env._b_page().evaluate(page_fetch, own)).startswith("reached")
        backend.browser.call(lambda: env._b_page().evaluate("url => { window.location.href = url; }",
                                                            f"{other}/health"))
        time.sleep(1)
        assert backend.browser.call(lambda: env._b_page().url).startswith(backend.local_sites[0])
        # a redirect from an allowed site to another port: the route filter never sees the hop, the egress
        # proxy does (each hop of a redirect is a request through it)
        with _redirector(f"{other}/health") as redirector:
            backend.origins.add(redirector)
            backend.browser.call(lambda: env._b_page().goto(f"{redirector}/go"))
            text = backend.browser.call(lambda: env._b_page().content())
            assert "blocked by the WebArena sandbox" in text and '"status"' not in text, text[:300]
            assert f"{other}/health" in backend.egress.refused
        env.close()
    finally:
        backend.shutdown()


@contextlib.contextmanager
def _redirector(target: str):
    """A local site whose every page answers 302 to ``target``; yields its origin."""
    import http.server
    import threading

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", target)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
    st.text(st.characters(exclude_categories=()), max_size=20),  # surrogates included
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
_IDS = st.integers(-2, 40) | st.integers() | st.text(max_size=3) | st.none()
_BODIES = _JSON | st.fixed_dictionaries({"id": _IDS}, optional={"action": _JSON, "data_idx": _IDS}) | \
    st.fixed_dictionaries({"steps": st.lists(st.fixed_dictionaries({"id": _IDS, "action": _JSON}), max_size=3)})
_PATHS = st.sampled_from(["/create", "/reset", "/step", "/step_batch", "/close", "/observation",
                          "/available_actions"])


@pytest.mark.parametrize("env", ["babyai", "textcraft", "deepsearch", "sciworld",
                                 pytest.param("webarena", marks=pytest.mark.browser)])
def test_fuzzed_requests_get_no_undocumented_5xx(env: str, own_server) -> None:
    """Property-based fuzzing of every endpoint with arbitrary JSON (surrogates, huge ints, wrong shapes) and
    ids that exist: every answer is a documented status (5xx only as 502/503), and the server stays healthy."""
    with httpx.Client(base_url=own_server(env), timeout=60) as http:
        live = [_new(http) for _ in range(2)]

        @settings(max_examples=150, deadline=None)
        @given(path=_PATHS, body=_BODIES)
        def fuzz(path: str, body: object) -> None:
            if isinstance(body, dict) and body.get("id") == -2:
                body = {**body, "id": live[0]}  # now and then a live instance
            if path in ("/observation", "/available_actions"):
                answer = http.get(path, params={"id": str(body.get("id") if isinstance(body, dict) else body)})
            else:
                answer = http.post(path, content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})
            assert answer.status_code < 500 or answer.status_code in (502, 503), (path, body, answer.text[:300])

        fuzz()
        assert http.get("/health").json()["status"] == "ok"


def test_deep_search_survives_a_long_query_and_a_dead_retriever() -> None:
    """A query over the retriever's 2,000 characters is cut, not a 502; a retriever that died shows in /health
    (503, reaped, no zombie) and the next search restarts it."""
    import psutil

    with running_server("deepsearch") as url, httpx.Client(base_url=url, timeout=120) as http:
        idx = _new(http, 0)
        long = http.post("/step", json={"id": idx, "action": f"<search>{'capital city ' * 300}</search>"})
        assert long.status_code == 200 and long.json()["observation"].startswith("<information>")
        server = psutil.Process(http.get("/health").json()["pid"])
        (retriever,) = [p for p in server.children() if "envs.deepsearch.retriever" in " ".join(p.cmdline())]
        retriever.kill()
        deadline = time.monotonic() + 30
        while (health := http.get("/health")).status_code == 200:  # until the server sees its child exited
            assert time.monotonic() < deadline, "/health still says ok 30 s after the retriever was killed"
            time.sleep(0.1)
        assert health.status_code == 503 and "the retriever" in health.json()["problem"]
        assert not psutil.pid_exists(retriever.pid)  # reaped, not a zombie
        again = http.post("/step", json={"id": idx, "action": "<search>capital city</search>"})
        assert again.status_code == 200 and again.json()["observation"].startswith("<information>")
        assert http.get("/health").status_code == 200
