"""WebArena: a real headless Chromium behind the environment server, the shipped sites, the evaluators."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from envs.launcher import running_server
from envs.webarena.backend import Backend, load_tasks
from envs.webarena.browser import ActionError, parse_action
from envs.webarena.client import Client
from envs.webarena.evaluators import EvaluatorConfigError, Judge, evaluate, program_html, string_match, url_match
from envs.webarena.expert import find_id, solve

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
browser = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
TASKS = json.loads((Path(__file__).parents[1] / "data" / "webarena" / "tasks.json").read_text())


def _reply(action: str) -> str:
    return f"Thought:\nok\n\nAction:\n{action}"


def test_action_grammar() -> None:
    assert parse_action("click [12]").element == 12
    typed = parse_action("type [7] [laptop bag] [0]")
    assert (typed.kind, typed.element, typed.text, typed.flag) == ("type", 7, "laptop bag", False)
    assert parse_action("type [7] [x]").flag is True  # WebArena presses Enter by default
    assert parse_action("stop [$899.00]").text == "$899.00" and parse_action("stop []").text == ""
    assert parse_action("goto [http://127.0.0.1/shop]").text == "http://127.0.0.1/shop"
    assert parse_action("scroll [down]").text == "down" and parse_action("tab_focus [1]").element == 1
    for bad in ("click", "click [x]", "type [3]", "scroll [left]", "fly [1]", "", "press []"):
        with pytest.raises(ActionError):
            parse_action(bad)


def test_evaluators_follow_webarena() -> None:
    assert string_match({"exact_match": "Shipped"}, " shipped ", "") == 1.0
    assert string_match({"exact_match": "Shipped"}, "It was shipped", "") == 0.0
    assert string_match({"must_include": ["water evenly", "mulch"]}, "Water evenly and mulch well.", "") == 1.0
    assert string_match({"fuzzy_match": "N/A"}, "N/A", "") == 1.0
    with pytest.raises(EvaluatorConfigError, match="judge"):
        string_match({"fuzzy_match": ["a cat"]}, "a feline", "what animal?")
    assert url_match("http://h/shop/search?q=kettle", "http://h/shop/search/?q=kettle&page=1") == 1.0
    assert url_match("http://h/shop/search?q=kettle", "http://h/shop/search?q=pan") == 0.0
    assert url_match("http://h/a |OR| http://h/b", "http://h/b") == 1.0
    pages = {"http://h/cart": "Aster 13 Laptop x 1\nTotal: $899.00"}
    targets = [{"url": "http://h/cart", "locator": "", "required_contents": {"must_include": ["Aster 13 Laptop x 1"]}}]
    assert program_html(targets, lambda url, loc, prep: pages[url], "http://h/cart") == 1.0
    targets[0]["required_contents"] = {"exact_match": "nothing"}
    assert program_html(targets, lambda url, loc, prep: pages[url], "http://h/cart") == 0.0
    task = {"intent": "x", "eval": {"eval_types": ["string_match", "url_match"],
                                    "reference_answers": {"exact_match": "a"}, "reference_url": "http://h/x"}}
    assert evaluate(task, "a", "http://h/x", lambda u, loc, prep: "") == 1.0
    assert evaluate(task, "a", "http://h/y", lambda u, loc, prep: "") == 0.0  # the product of the evaluators


def test_fuzzy_match_asks_an_openai_compatible_judge() -> None:
    """A judge server speaking the chat-completions protocol on localhost."""
    from fastapi import FastAPI, Header

    from tests.conftest import serving

    app = FastAPI()
    seen: list[str] = []

    @app.post("/v1/chat/completions")
    def chat(body: dict, authorization: str = Header("")) -> dict:
        prompt = body["messages"][0]["content"]
        seen.append(f"{body['model']} {authorization}\n{prompt}")
        verdict = "correct" if "feline" in prompt.split("Student answer:")[1] else "incorrect"
        return {"choices": [{"message": {"role": "assistant", "content": verdict}}]}

    with serving(app) as url:
        judge = Judge(url, "qwen-judge", "sk-test-123")
        assert string_match({"fuzzy_match": ["a cat"]}, "a feline", "what animal?", judge) == 1.0
        assert string_match({"fuzzy_match": ["a cat"]}, "a dog", "what animal?", judge) == 0.0
        assert "Reference answer: a cat" in seen[0]
        assert seen[0].startswith("qwen-judge Bearer sk-test-123")  # the model and the key reach the judge
        assert "sk-test-123" not in repr(judge)  # ... and never its repr (logs)


def test_webarena_format_task_folders_load_and_name_missing_sites(tmp_path) -> None:
    for i, task in enumerate(TASKS[:3]):
        (tmp_path / f"{i}.json").write_text(json.dumps(task))
    (tmp_path / "10.json").write_text(json.dumps({**TASKS[0], "task_id": 10, "start_url": "__GITLAB__/explore"}))
    tasks = load_tasks(tmp_path)
    assert [t["task_id"] for t in tasks] == [0, 1, 2, 10]  # numeric order, as WebArena's config files
    with pytest.raises(ValueError, match="gitlab=URL"):
        Backend(tasks=str(tmp_path), chromium=CHROMIUM if Path(CHROMIUM).exists() else "/bin/sh")
    with pytest.raises(FileNotFoundError, match="chromium"):
        Backend(chromium="/nonexistent/chromium")


@browser
@pytest.mark.browser
def test_observation_is_an_accessibility_tree_and_bad_actions_are_explained(env_server) -> None:
    client = Client(env_server("webarena"))
    first = client.reset(0)
    assert first.observation.startswith(f"OBJECTIVE: {TASKS[0]['intent']}\nURL: http://webarena.local/shop/")
    assert client.reset(0).observation == first.observation  # element ids and URLs do not depend on the run
    assert "PREVIOUS ACTION: None" in first.observation and "RootWebArea 'One Stop Shop'" in first.observation
    laptops = find_id(first.observation, "link", "Laptops")
    assert laptops is not None
    out = client.step(_reply(f"click [{laptops}]"))

    def url(o: object) -> str:
        return o.observation.split("URL: ")[1].split("\n")[0]

    assert url(out).endswith("/shop/category/Laptops") and f"PREVIOUS ACTION: click [{laptops}]" in out.observation
    assert url(client.step(_reply("go_back"))).endswith("/shop/")
    assert url(client.step(_reply("go_forward"))).endswith("/shop/category/Laptops")
    assert url(client.step(_reply("goto [http://webarena.local/shop/]"))) == "http://webarena.local/shop/"
    tabs = client.step(_reply("new_tab"))
    assert "Tab 1 (current)" in tabs.observation
    assert "Tab 0 (current)" in client.step(_reply("close_tab")).observation
    assert "Invalid action" in client.step(_reply("jump [3]")).observation
    assert "no element [999999]" in client.step(_reply("click [999999]")).observation
    gone = client.step(_reply("goto [http://127.0.0.1:9/nothing]"))  # outside the sandbox: refused, explained
    assert "goto is limited to this environment's sites" in gone.observation and not gone.done
    client.step(_reply("go_back"))
    end = client.step(_reply("stop [$899.00]"))
    assert end.done and end.success and end.reward == 1.0
    client.close()


@browser
@pytest.mark.browser
def test_episodes_are_isolated_and_the_context_pool_is_bounded() -> None:
    from envs.urls import ServerUrls
    from training.phases.trainer import CapacityConfigError, check_capacity

    with running_server("webarena", max_contexts=3) as url:
        assert httpx.get(f"{url}/health").json()["capacity"] == 3
        check_capacity(ServerUrls.parse(url, ["webarena"]), 3)
        with pytest.raises(CapacityConfigError, match="batch_items x n_samples = 4"):
            check_capacity(ServerUrls.parse(url, ["webarena"]), 4)  # the trainer refuses before any rollout
        clients = [Client(url) for _ in range(3)]
        task = next(i for i, t in enumerate(TASKS) if t["intent"].startswith("Add the Echo Studio"))

        with ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(lambda c: solve(c, task), clients))
        # the evaluator reads "Echo Studio Headphones x 1" in each episode's cart: shared state would show x 2, x 3
        assert [o.success for o in outcomes] == [True, True, True]
        extra = Client(url)
        refused = extra.http.post("/reset", json={"id": extra.id, "data_idx": 0})
        assert refused.status_code == 503 and "max_contexts" in refused.json()["detail"]
        clients[0].close()
        assert extra.http.post("/reset", json={"id": extra.id, "data_idx": 0}).status_code == 200
        for c in [*clients[1:], extra]:
            c.close()
        assert httpx.get(f"{url}/health").json()["instances"] == 0
    with running_server("webarena", memory_limit_mb=1) as url:  # chromium alone is far above 1 MB
        client = Client(url)
        refused = client.http.post("/reset", json={"id": client.id, "data_idx": 0})
        assert refused.status_code == 503 and "memory_limit_mb=1" in refused.json()["detail"]
        client.close()


@browser
@pytest.mark.browser
@pytest.mark.slow
def test_scripted_solutions_of_every_local_task_succeed_through_http(env_server) -> None:
    client = Client(env_server("webarena"))
    failed = [t["intent"] for i, t in enumerate(TASKS) if not solve(client, i).success]
    client.close()
    assert len(TASKS) >= 30 and failed == []
    assert len({t["category"] for t in TASKS}) == 6


@browser
@pytest.mark.browser
@pytest.mark.slow
def test_open_close_cycles_do_not_leak_browser_contexts_or_memory() -> None:
    with running_server("webarena") as url:
        server = psutil.Process(httpx.get(f"{url}/health").json()["pid"])

        def browser_rss() -> float:
            total = 0
            for proc in server.children(recursive=True):
                try:  # chromium's helper processes come and go
                    if "chrom" in proc.name().lower():
                        total += proc.memory_info().rss
                except psutil.Error:
                    continue
            return total / 2**20

        def cycle(i: int) -> None:
            client = Client(url)
            client.reset(i % len(TASKS))
            client.step(_reply("scroll [down]"))
            client.close()

        for i in range(10):
            cycle(i)
        before = browser_rss()
        for i in range(40):
            cycle(i)
        after = browser_rss()
        assert httpx.get(f"{url}/health").json()["instances"] == 0
    assert after - before < 150, (before, after)
