"""The HTTP clients: prompts, local rejection of malformed replies, sync/async parity, batch stepping."""

from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest

from envs.client import (
    EnvServerError,
    async_env_http,
    env_http,
    health_capacity,
    server_capacity,
    step_many,
    tls_context,
)
from envs.launcher import running_server
from envs.react import MULTIPLE_ACTIONS
from envs.registry import SERVED, UnknownEnvironmentError, async_client_class, client_class, load_backend


@pytest.mark.parametrize("env", SERVED)
def test_every_client_carries_an_instruction_prompt(env: str) -> None:
    human, gpt = client_class(env).conversation_start
    action_format = "<search>" if env == "deepsearch" else "Action"
    assert human["from"] == "human" and action_format in human["value"] and len(human["value"]) > 200
    assert gpt["from"] == "gpt" and gpt["value"]
    assert async_client_class(env).conversation_start == client_class(env).conversation_start


def test_unknown_environment_names_the_choices() -> None:
    with pytest.raises(UnknownEnvironmentError, match="babyai, textcraft, sciworld"):
        load_backend("minecraft")


def test_malformed_reply_is_answered_locally_without_a_request(env_server) -> None:
    sent: list[str] = []
    url = env_server("textcraft")
    with httpx.Client(base_url=url, event_hooks={"request": [lambda r: sent.append(r.url.path)]}) as http:
        client = client_class("textcraft")(url, http=http)
        client.reset(0)
        sent.clear()
        out = client.step("Thought: two at once\nAction: inventory\nAction: inventory")
        assert out.observation == MULTIPLE_ACTIONS and out.reward == 0.0 and not out.done and not out.sent
        assert sent == []
        out = client.step("Thought: fine\nAction: inventory")
        assert out.sent and out.observation.startswith("Inventory") and sent == ["/step"]
        client.close()


def test_step_many_sends_one_request_for_a_round(env_server) -> None:
    sent: list[str] = []
    url = env_server("textcraft")
    with httpx.Client(base_url=url, event_hooks={"request": [lambda r: sent.append(r.url.path)]}) as http:
        clients = [client_class("textcraft")(url, http=http) for _ in range(5)]
        for i, c in enumerate(clients):
            c.reset(i)
        sent.clear()
        replies = ["Thought: x\nAction: inventory"] * 4 + ["no action here"]
        outs = step_many(clients, replies)
        assert sent == ["/step_batch"]
        assert [o.sent for o in outs] == [True] * 4 + [False]
        assert all(o.observation.startswith("Inventory") for o in outs[:4])
        for c in clients:
            c.close()


def test_server_errors_raise_with_the_servers_message(env_server) -> None:
    client = client_class("textcraft")(env_server("textcraft"))
    with pytest.raises(EnvServerError, match="out of range") as err:
        client.reset(10**6)
    assert err.value.status_code == 422
    client.close()


def test_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(EnvServerError, match="cannot reach"):
        client_class("babyai")("http://127.0.0.1:9")
    with pytest.raises(EnvServerError, match=r"cannot reach http://127\.0\.0\.1:9"):
        server_capacity("http://127.0.0.1:9")


def test_server_capacity_is_the_pool_bound_or_the_instance_limit(env_server) -> None:
    textcraft = env_server("textcraft")  # in-process simulators: no pool, the server's instance limit
    assert server_capacity(textcraft) == httpx.get(f"{textcraft}/health").json()["max_instances"] > 4
    assert server_capacity(env_server("sciworld")) == 4  # the JVM pool (max_jvms of the session server)
    with running_server("babyai", max_instances=3) as url:
        assert server_capacity(url) == 3
    assert health_capacity({"status": "ok"}) is None  # a server that names no bound (not one of ours)


def test_async_client_matches_sync_client(env_server) -> None:
    url = env_server("babyai")
    sync = client_class("babyai")(url)
    expected = [sync.reset(7).observation]
    expected += [sync.step(f"Action: {a}").observation for a in ("turn left", "move forward")]
    sync.close()

    async def play() -> list[str]:
        client = await async_client_class("babyai").create(url)
        seen = [(await client.reset(7)).observation]
        for a in ("turn left", "move forward"):
            seen.append((await client.step(f"Action: {a}")).observation)
        assert await client.available_actions()
        await client.close()
        return seen

    assert asyncio.run(play()) == expected


def test_async_open_many_and_close_many_match_the_sync_pair() -> None:
    """aopen_many opens and resets a batch in one request (a full server's item a retryable 429, the rest opened)
    as open_many does; its clients step their instances; aclose_many closes them and lists what was already gone."""
    from envs.client import EnvServerError, aclose_many, aopen_many, close_many, open_many

    with running_server("babyai", max_instances=3) as url:
        with httpx.Client(base_url=url) as http:
            opened = open_many(client_class("babyai"), http, [5, 6])
            expected = [first.observation for _, first in opened]
            assert close_many([client for client, _ in opened]) == []

        async def play() -> dict:
            async with httpx.AsyncClient(base_url=url) as http:
                opened = await aopen_many(async_client_class("babyai"), http, [5, 6, 7, 8])
                errors = [o for o in opened if isinstance(o, EnvServerError)]
                clients = [o[0] for o in opened if not isinstance(o, EnvServerError)]
                return {"firsts": [o[1].observation for o in opened if not isinstance(o, EnvServerError)],
                        "errors": [(e.status_code, e.retryable) for e in errors],
                        "stepped": (await clients[0].step("Action: turn left")).observation,
                        "missing": await aclose_many(clients), "again": await aclose_many(clients),
                        "ids": [c.id for c in clients], "live": (await http.get("/health")).json()["instances"]}

        seen = asyncio.run(play())
    assert seen["firsts"][:2] == expected and len(seen["firsts"]) == 3 and seen["errors"] == [(429, True)]
    assert seen["stepped"] and seen["missing"] == [] and seen["again"] == seen["ids"] and seen["live"] == 0


def test_clients_share_one_verifying_tls_context() -> None:
    """Building a TLS context costs ~20 ms of CPU: every client (and every health poll) shares one, which still
    verifies certificates and host names."""
    clients = [env_http("http://127.0.0.1:1"), env_http("https://example.invalid")]
    contexts = {id(c._transport._pool._ssl_context) for c in clients}  # type: ignore[attr-defined]
    aclient = async_env_http("http://127.0.0.1:1")
    contexts.add(id(aclient._transport._pool._ssl_context))  # type: ignore[attr-defined]
    assert contexts == {id(tls_context())}
    assert tls_context().verify_mode == ssl.CERT_REQUIRED and tls_context().check_hostname
    for c in clients:
        c.close()
    asyncio.run(aclient.aclose())
