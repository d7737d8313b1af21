"""The multi-turn rollout against real environment servers: turn caps, token bookkeeping, replayed
experts, determinism, environment failures and cleanup."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from envs.launcher import running_server
from envs.local import local_client
from envs.registry import expert
from envs.splits import item_index, load_split
from training.chat_format import ChatFormat, opening_messages
from training.engines.engine import Generation, HFEngine, ScriptedEngine
from training.rollouts.rollout import Rollout, RolloutConfig
from training.settings.config import curriculum_config


def _engine(policy) -> HFEngine:
    model, tokenizer = policy
    return HFEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _items(env: str, n: int) -> list[str]:
    return [r["item_id"] for r in load_split(env, "train")[:n]]


@pytest.mark.parametrize("env", ["babyai", "textcraft", "deepsearch", pytest.param("sciworld", marks=pytest.mark.jvm),
                                 pytest.param("webarena", marks=pytest.mark.browser)])
def test_tiny_model_rollouts_respect_the_curriculum_turn_cap(env: str, env_server, tiny_policy) -> None:
    h = curriculum_config(env, "smoke").phases()[0].h
    url = env_server(env)
    live = _live(url)  # the server is shared by a worker's tests: this one must close what it opened
    config = RolloutConfig(n_samples=2, max_new_tokens=24, context_budget=4096, seed=1)
    items = _items(env, 2 if env == "sciworld" else 3)  # the session's SciWorld server holds 4 JVMs
    result = Rollout(env, url, _engine(tiny_policy), tiny_policy[1], config).run(items, h=h)
    assert len(result.trajectories) == 2 * len(items)
    for t in result.trajectories:
        assert 1 <= len(t.turns) <= h
        assert t.termination in {"done", "turn_cap", "context_cap"}  # no budget beyond those was set
        assert len(t.input_ids) == len(t.loss_mask) == len(t.logprobs)
        assert sum(t.loss_mask) > 0 and all(lp <= 0 for lp in t.logprobs)
    assert result.stats["rollout/trajectories"] == 2 * len(items) and result.generated_tokens > 0
    assert _live(url) == live


def _expert_replies(env: str, data_idx: int) -> tuple[list[str], float]:
    """The replies an expert sends on ``data_idx`` and the reward it reaches (run in-process)."""
    client = local_client(env)
    replies: list[str] = []
    original = client.step

    def step(reply: str):
        replies.append(reply)
        return original(reply)

    client.step = step  # type: ignore[method-assign]
    final = expert(env)(client, data_idx)
    client.close()
    return replies, final.reward


def _script(env: str, item: str, chat: ChatFormat) -> tuple[tuple[int, ...], list[str], float]:
    """(initial prompt ids, expert replies, expert reward) of one item."""
    replies, reward = _expert_replies(env, item_index(item))
    first = local_client(env)
    observation = first.reset(item_index(item)).observation
    first.close()
    return tuple(chat.prompt(opening_messages(first.conversation_start, observation))), replies, reward


@pytest.mark.parametrize("env", ["textcraft", "babyai", "deepsearch"])
def test_expert_replayed_through_the_rollout_reaches_the_experts_reward(env: str, env_server, tiny_policy) -> None:
    tokenizer = tiny_policy[1]
    chat = ChatFormat(tokenizer)
    items = _items(env, 4)
    scripts, rewards = {}, {}
    for item in items:
        key, replies, reward = _script(env, item, chat)
        scripts[key] = replies
        rewards[item] = (reward, len(replies))
    config = RolloutConfig(max_new_tokens=512, context_budget=100_000)
    result = Rollout(env, env_server(env), ScriptedEngine(tokenizer, scripts), tokenizer, config).run(items, h=200)
    for t in result.trajectories:
        reward, turns = rewards[t.item_id]
        assert t.termination == "done" and t.success
        assert t.reward == pytest.approx(reward) and len(t.turns) == turns
        assert t.token_rewards()[t.reward_index] == pytest.approx(reward) and t.loss_mask[t.reward_index] == 1
        assert sum(t.token_rewards()) == pytest.approx(reward)  # only on the last assistant token


@pytest.mark.parametrize("env", ["babyai", "textcraft"])
def test_async_mode_gives_the_same_trajectories_as_lockstep(env: str, env_server, tiny_policy) -> None:
    """Asynchronous trajectories (generations batched by what is ready, three at a time, steps in flight
    meanwhile) with scripted experts of different lengths: the same set of trajectories as lock-step rounds,
    token for token, each ended by its own turn cap."""
    tokenizer = tiny_policy[1]
    chat = ChatFormat(tokenizer)
    items = _items(env, 12)
    scripts = {}
    for item in items:
        key, replies, _ = _script(env, item, chat)
        scripts[key] = replies
    lengths = sorted(len(r) for r in scripts.values())
    assert lengths[0] < lengths[-1], lengths  # experts of different lengths: trajectories end at different turns
    h = lengths[-1] - 1  # the longest experts are cut by the cap, the others finish
    runs = {}
    for mode in ("lockstep", "async", "async-each"):
        config = RolloutConfig(n_samples=2, max_new_tokens=512, context_budget=100_000, mode=mode.split("-")[0],
                               async_batch=3)
        engine = ScriptedEngine(tokenizer, scripts)
        engine.concurrent = mode == "async-each"  # each trajectory its own calls, as with a vLLM server
        result = Rollout(env, env_server(env), engine, tokenizer, config).run(items, h=h)
        runs[mode] = sorted((t.group, t.sample, tuple(t.input_ids), t.termination, t.reward, len(t.turns))
                            for t in result.trajectories)
    assert runs["async"] == runs["lockstep"] == runs["async-each"]
    assert {r[3] for r in runs["async"]} == {"done", "turn_cap"}


def test_async_mode_admits_trajectories_as_instances_free(env_server, tiny_policy) -> None:
    """A server that holds 5 instances and a rollout of 24 trajectories, no retries: lock-step rounds cannot (the
    resets past the fifth are refused), the asynchronous mode admits each trajectory as another ends and closes
    its instance, and gives the trajectories lock-step gives on an unbounded server, none left open."""
    tokenizer = tiny_policy[1]
    chat = ChatFormat(tokenizer)
    items = _items("babyai", 12)
    scripts = {}
    for item in items:
        key, replies, _ = _script("babyai", item, chat)
        scripts[key] = replies
    h = max(len(r) for r in scripts.values()) - 1

    def run(url: str, mode: str, concurrent: bool = False) -> list[tuple]:
        config = RolloutConfig(n_samples=2, max_new_tokens=512, context_budget=100_000, mode=mode, async_batch=2,
                               retries=0)
        engine = ScriptedEngine(tokenizer, scripts)
        engine.concurrent = concurrent
        result = Rollout("babyai", url, engine, tokenizer, config).run(items, h=h)
        return sorted((t.group, t.sample, tuple(t.input_ids), t.termination, t.reward, len(t.turns))
                      for t in result.trajectories)

    unbounded = run(env_server("babyai"), "lockstep")
    with running_server("babyai", max_instances=5) as small:
        assert sum(r[3] == "env_error" for r in run(small, "lockstep")) == 24 - 5
        assert _live(small) == 0
        assert run(small, "async") == unbounded
        assert run(small, "async", concurrent=True) == unbounded  # one thread per trajectory, 5 at a time
        assert _live(small) == 0


def test_token_ids_and_loss_mask_equal_the_chat_templates(env_server, tiny_policy) -> None:
    tokenizer = tiny_policy[1]
    chat = ChatFormat(tokenizer)
    item = _items("textcraft", 1)[0]
    key, replies, _ = _script("textcraft", item, chat)
    scripts = {key: replies}
    config = RolloutConfig(max_new_tokens=512, context_budget=100_000)
    t = Rollout("textcraft", env_server("textcraft"), ScriptedEngine(tokenizer, scripts), tokenizer,
                config).run([item], h=200).trajectories[0]
    rendered = tokenizer.apply_chat_template(t.messages, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    expected_ids, expected_mask = rendered["input_ids"], rendered["assistant_masks"]
    tail = len(expected_ids) - len(t.input_ids)  # the template's newline after the final end-of-turn
    assert tail == 1 and tokenizer.decode(expected_ids[-tail:]) == "\n"
    assert t.input_ids == expected_ids[:-tail]
    # The instruction's acknowledgement is an assistant message of the prompt: never sampled, never trained.
    prompt = t.prompt_length
    assert any(expected_mask[:prompt]) and not any(t.loss_mask[:prompt])
    assert t.loss_mask[prompt:] == list(expected_mask[prompt:-tail])
    assert t.input_ids.count(tokenizer.eos_token_id) == 3 + 2 * len(t.turns) - 1


def _long_conversation(turns: int) -> tuple[list[dict[str, str]], list[str]]:
    """An opening (system, instruction, acknowledgement, first observation), then ``turns`` assistant turns, each
    followed by its observation; returns the messages before each observation and the observations."""
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Go to the ball."},
                {"role": "assistant", "content": "OK"}, {"role": "user", "content": "You see a wall."}]
    befores, observations = [], []
    for k in range(turns):
        messages = [*messages, {"role": "assistant", "content": f"Thought: step {k}.\nAction: turn left"}]
        befores.append(messages)
        observations.append(f"Turn {k}: a red ball {k} steps forward.\n")
        messages = [*messages, {"role": "user", "content": observations[-1]}]
    return befores, observations


def test_observation_pieces_from_a_bounded_context_equal_the_whole_conversations(tiny_policy) -> None:
    """Each turn's observation ids come from the opening and the last assistant turn only (a turn's cost does not
    grow with the history), batched in one tokenizer call, and equal what the whole conversation renders."""
    tokenizer = tiny_policy[1]
    chat = ChatFormat(tokenizer)
    befores, observations = _long_conversation(12)
    whole = [chat.encode(chat._render_piece(m, o)) for m, o in zip(befores, observations, strict=True)]
    assert chat.observation_pieces(list(zip(befores, observations, strict=True))) == whole
    assert [chat.observation_piece(m, o) for m, o in zip(befores, observations, strict=True)] == whole
    assert chat._bounded  # the tiny template renders a turn the same in any history: the bounded context is kept
    assert len(chat._bounded_context(befores[-1])) == 3 < len(befores[-1])
    # and it puts an observation into its turn verbatim: past the checks, pieces are cut from that frame
    frame = ("\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert chat._framed and list(chat._frames.values()) == [frame]
    assert chat._frame_checks_left == 0 and chat._checks_left < 0  # 4 checked of each kind, the rest cut


@pytest.mark.parametrize("change", ["trim", "replace"])
def test_a_template_that_changes_an_observation_gets_it_rendered(tiny_policy, change: str) -> None:
    """A template that trims what it renders has no frame (the sentinels' white space shows it); one that changes
    only some words is caught by the first rendered check; either way every piece is the template's own."""
    import copy

    tokenizer = copy.deepcopy(tiny_policy[1])
    rendered = "{%- else %}{{- message['content']"
    assert tokenizer.chat_template.count(rendered) == 1
    tokenizer.chat_template = tokenizer.chat_template.replace(
        rendered, rendered + ("|trim" if change == "trim" else "|replace('ball', 'BALL')"))
    chat = ChatFormat(tokenizer)
    befores, observations = _long_conversation(8)
    whole = [chat.encode(chat._render_piece(m, o)) for m, o in zip(befores, observations, strict=True)]
    assert [chat.observation_piece(m, o) for m, o in zip(befores, observations, strict=True)] == whole
    assert chat._bounded
    if change == "trim":
        assert list(chat._frames.values()) == [None]  # no frame: every piece rendered
    else:
        assert list(chat._frames.values()) != [None] and not chat._framed  # a frame, turned off by the first check


def test_a_template_that_looks_at_the_history_gets_the_whole_conversation(tiny_policy) -> None:
    """A chat template that numbers the user turns renders an observation differently without the history: the
    first check finds it, and every piece, that one included, is the whole conversation's."""
    import copy

    tokenizer = copy.deepcopy(tiny_policy[1])
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{%- else %}{{- message['content']", "{%- else %}{{- loop.index|string + ': ' + message['content']")
    chat = ChatFormat(tokenizer)
    befores, observations = _long_conversation(8)
    whole = [chat.encode(chat._render_piece(m, o)) for m, o in zip(befores, observations, strict=True)]
    assert chat.encode(chat._render_piece(chat._bounded_context(befores[-1]), observations[-1])) != whole[-1]
    assert [chat.observation_piece(m, o) for m, o in zip(befores, observations, strict=True)] == whole
    assert not chat._bounded


def test_encoded_texts_are_kept_the_most_recent_and_give_the_tokenizers_ids(tiny_policy, monkeypatch) -> None:
    """A text met again is not tokenised again (one tokenizer call for the texts not kept, each once), its ids are
    the tokenizer's, a caller cannot change what is kept by changing what it got, and only the ENCODED_TEXTS texts
    met most recently are kept, ENCODED_IDS ids at most."""
    import training.chat_format as chat_format_module

    tokenizer = tiny_policy[1]
    monkeypatch.setattr(chat_format_module, "ENCODED_TEXTS", 3)
    chat = ChatFormat(tokenizer)
    calls = []
    real = chat.tokenizer

    class Counting:
        def __call__(self, texts, **kwargs):
            calls.append(list(texts))
            return real(texts, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    chat.tokenizer = Counting()
    texts = ["go to the red ball", "open the door", "go to the red ball", "pick up the key"]
    expected = [real(t, add_special_tokens=False)["input_ids"] for t in texts]
    first = chat.encode_many(texts)
    assert first == expected and calls == [["go to the red ball", "open the door", "pick up the key"]]
    first[0].append(-1)  # the caller's copy
    assert chat.encode_many(["go to the red ball"]) == [expected[0]] and len(calls) == 1
    assert (chat.encode_hits, chat.encode_misses) == (2, 3)
    chat.encode_many(["a fourth text"])  # the text met longest ago ("open the door") is dropped
    assert list(chat._encoded) == ["pick up the key", "go to the red ball", "a fourth text"]
    assert chat.encode_many(["open the door"]) == [expected[1]] and calls[-1] == ["open the door"]
    group = [[{"role": "user", "content": "a task"}]] * 4
    assert chat.prompts(group) == [chat.prompt(group[0])] * 4 and calls[-1] == [chat.render(group[0], True)]
    long = "a long observation " * 50
    monkeypatch.setattr(chat_format_module, "ENCODED_IDS", len(real(long, add_special_tokens=False)["input_ids"]) + 5)
    assert chat.encode_many([long]) == [real(long, add_special_tokens=False)["input_ids"]]
    assert list(chat._encoded) == [long]  # the others were dropped to keep within ENCODED_IDS
    assert chat._encoded_ids == sum(len(ids) for ids in chat._encoded.values())



def test_sft_tokenises_an_episode_exactly_as_the_rollout_does(env_server, tiny_policy) -> None:
    """One prompt builder and one turn layout: an expert episode fed to SFT gives the very ids and loss mask of
    the same episode rolled out through the server (so SFT trains on what RL will sample from)."""
    from training.warmstart.sft import to_trajectory

    tokenizer = tiny_policy[1]
    chat = ChatFormat(tokenizer)
    item = _items("textcraft", 1)[0]
    key, replies, _ = _script("textcraft", item, chat)
    config = RolloutConfig(max_new_tokens=512, context_budget=100_000)
    t = Rollout("textcraft", env_server("textcraft"), ScriptedEngine(tokenizer, {key: replies}), tokenizer,
                config).run([item], h=200).trajectories[0]
    sft = to_trajectory(t.messages, tokenizer)
    assert sft.input_ids == t.input_ids and sft.loss_mask == t.loss_mask


def test_same_seed_same_trajectories(env_server, tiny_policy) -> None:
    url = env_server("babyai")
    config = RolloutConfig(n_samples=2, max_new_tokens=16, seed=7)
    runs = [Rollout("babyai", url, _engine(tiny_policy), tiny_policy[1], config).run(_items("babyai", 2), h=2)
            for _ in range(2)]
    assert [t.input_ids for t in runs[0].trajectories] == [t.input_ids for t in runs[1].trajectories]
    assert [t.logprobs for t in runs[0].trajectories] == [t.logprobs for t in runs[1].trajectories]
    other = Rollout("babyai", url, _engine(tiny_policy), tiny_policy[1],
                    RolloutConfig(n_samples=2, max_new_tokens=16, seed=8)).run(_items("babyai", 2), h=2)
    assert [t.input_ids for t in other.trajectories] != [t.input_ids for t in runs[0].trajectories]


def test_context_budget_stops_a_trajectory(env_server, tiny_policy) -> None:
    config = RolloutConfig(max_new_tokens=16, context_budget=900)
    result = Rollout("textcraft", env_server("textcraft"), _engine(tiny_policy), tiny_policy[1],
                     config).run(_items("textcraft", 2), h=20)
    assert {t.termination for t in result.trajectories} == {"context_cap"}
    assert all(len(t.input_ids) <= 900 for t in result.trajectories)


def test_token_and_time_budgets_end_trajectories_and_say_so(env_server, tiny_policy) -> None:
    """Budgets per trajectory beside h and the context clamp: its generated tokens (never passed: a turn that could
    pass it is not started) and its wall-clock time (checked after each turn); each trajectory records which
    ended it, and the rollout's metrics count them."""
    url = env_server("textcraft")
    tokens = Rollout("textcraft", url, _engine(tiny_policy), tiny_policy[1],
                     RolloutConfig(n_samples=2, max_new_tokens=16, context_budget=100_000,
                                   max_trajectory_tokens=40)).run(_items("textcraft", 2), h=20)
    assert {t.termination for t in tokens.trajectories} <= {"token_cap", "done"}
    assert any(t.termination == "token_cap" for t in tokens.trajectories)
    assert all(sum(t.loss_mask) <= 40 for t in tokens.trajectories)
    assert tokens.stats["rollout/termination/token_cap"] >= 1
    timed = Rollout("textcraft", url, _engine(tiny_policy), tiny_policy[1],
                    RolloutConfig(n_samples=2, max_new_tokens=16, context_budget=100_000,
                                  max_trajectory_seconds=1e-6)).run(_items("textcraft", 2), h=20)
    assert {t.termination for t in timed.trajectories} <= {"time_cap", "done"}
    assert all(len(t.turns) == 1 for t in timed.trajectories)
    assert timed.stats["rollout/termination/time_cap"] >= 1


class _Boom(RuntimeError):
    pass


def test_every_instance_is_closed_when_the_engine_fails(env_server, tiny_policy) -> None:
    url = env_server("babyai")

    class Failing(HFEngine):
        calls = 0

        def generate(self, prompts, params):
            Failing.calls += 1
            if Failing.calls == 2:
                raise _Boom("engine died")
            return super().generate(prompts, params)

    model, tokenizer = tiny_policy
    engine = Failing(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    live = _live(url)
    with pytest.raises(_Boom):
        Rollout("babyai", url, engine, tokenizer, RolloutConfig(n_samples=3, max_new_tokens=8)).run(
            _items("babyai", 2), h=5)
    assert _live(url) == live


def test_a_dead_server_marks_trajectories_invalid_not_zero(tiny_policy) -> None:
    tokenizer = tiny_policy[1]
    with running_server("textcraft") as url:
        server = httpx.get(f"{url}/health").json()["pid"]

        class KillsServer:
            """Writes a valid action (so the round reaches the server), after killing the server."""

            eos_token_id = tokenizer.eos_token_id

            def generate(self, prompts: list, params: object) -> list[Generation]:
                os.kill(server, signal.SIGKILL)
                text = "Thought: look.\nAction: inventory"
                ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], self.eos_token_id]
                return [Generation(ids, [0.0] * len(ids), True) for _ in prompts]

        engine = KillsServer()
        config = RolloutConfig(n_samples=2, max_new_tokens=8, retries=2, backoff_s=0.05)
        result = Rollout("textcraft", url, engine, tokenizer, config).run(_items("textcraft", 2), h=3)
    assert {t.termination for t in result.trajectories} == {"env_error"}
    assert result.valid == [] and result.stats["env/errors"] == 4
    assert all("cannot reach" in (t.error or "") for t in result.trajectories)


def test_bad_item_ids_fail_loudly(env_server, tiny_policy) -> None:
    from envs.client import EnvServerError

    live = _live(env_server("textcraft"))
    with pytest.raises(EnvServerError, match="out of range"):
        Rollout("textcraft", env_server("textcraft"), _engine(tiny_policy), tiny_policy[1],
                RolloutConfig()).run(["textcraft_9999"], h=1)
    assert _live(env_server("textcraft")) == live


def test_rollout_log_is_one_json_line_per_trajectory(env_server, tiny_policy, tmp_path) -> None:
    import json

    from training.rollouts.rollout import write_rollout_log

    config = RolloutConfig(n_samples=2, max_new_tokens=8)
    result = Rollout("babyai", env_server("babyai"), _engine(tiny_policy), tiny_policy[1], config).run(
        _items("babyai", 2), h=2)
    path = write_rollout_log(tmp_path / "rollouts" / "step_3.jsonl", result, step=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and all(r["step"] == 3 for r in rows)
    assert {r["item_id"] for r in rows} == set(_items("babyai", 2))
    for row, t in zip(rows, result.trajectories, strict=True):
        assert row["termination"] == t.termination and row["turns"] == len(t.turns) == len(row["turn_records"])
        assert row["agent_tokens"] == sum(t.loss_mask) > 0
        assert row["conversation"][0]["role"] == "user" and row["reward"] == t.reward


def _live(url: str) -> int:
    """Live instances on a server (shared by a worker's tests, so tests compare before and after)."""
    return int(httpx.get(f"{url}/health").json()["instances"])


class _TurnLeft:
    """A scripted policy whose every reply is a valid action (so each round really steps the servers); calls
    ``hook`` with the call count before each generation."""

    def __init__(self, tokenizer, hook=lambda calls: None) -> None:
        self.ids = [*tokenizer("Thought: look around.\nAction: turn left", add_special_tokens=False)["input_ids"],
                    tokenizer.eos_token_id]
        self.hook, self.calls = hook, 0

    def generate(self, prompts, params):
        self.calls += 1
        self.hook(self.calls)
        return [Generation(list(self.ids), [0.0] * len(self.ids), True) for _ in prompts]


def test_lock_step_opens_and_closes_in_one_request_and_a_server_without_them_one_by_one(tiny_policy) -> None:
    """A lock-step rollout opens its instances with one /create_batch and closes them with one /close_batch; a
    server without those endpoints (AgentGym's own) gets /create, /reset and /close per trajectory, with the same
    trajectories, and nothing left open on either. The asynchronous mode opens what a server has room for in one
    request and closes the trajectories that end together in one."""
    import dataclasses
    from collections import Counter

    from envs.registry import load_backend
    from envs.server import create_app
    from tests.conftest import serving

    tokenizer = tiny_policy[1]
    items = _items("babyai", 3)
    config = RolloutConfig(n_samples=2, max_new_tokens=12, seed=3, retries=1, backoff_s=0.05)
    plain = create_app(load_backend("babyai"))
    plain.router.routes = [r for r in plain.router.routes
                           if getattr(r, "path", "") not in ("/create_batch", "/close_batch")]
    runs = {}
    for name, app in (("batched", create_app(load_backend("babyai"))), ("agentgym", plain)):
        paths: Counter[str] = Counter()
        with serving(app) as url, httpx.Client(base_url=url, timeout=60, event_hooks={
                "request": [lambda request, paths=paths: paths.update([request.url.path])]}) as http:
            rollout = Rollout("babyai", url, _TurnLeft(tokenizer), tokenizer, config, http=http)
            runs[name] = rollout.run(items, h=2)
            assert httpx.get(f"{url}/health").json()["instances"] == 0
        runs[name].paths, runs[name].no_batch = dict(paths), rollout.no_batch
    assert runs["batched"].paths == {"/create_batch": 1, "/step_batch": 2, "/close_batch": 1}
    assert runs["batched"].no_batch == set()
    agentgym = runs["agentgym"].paths
    assert (agentgym["/create"], agentgym["/reset"], agentgym["/close"]) == (6, 6, 6) and agentgym["/create_batch"] == 1
    assert runs["agentgym"].no_batch == {0}
    assert [t.input_ids for t in runs["agentgym"].trajectories] == [t.input_ids for t in runs["batched"].trajectories]
    assert all(t.valid for t in runs["batched"].trajectories)
    paths = Counter()
    with serving(create_app(load_backend("babyai"), max_instances=4)) as url, httpx.Client(
            base_url=url, timeout=60, event_hooks={"request": [lambda request: paths.update([request.url.path])]}
    ) as http:
        cfg = dataclasses.replace(config, mode="async", async_batch=2)
        result = Rollout("babyai", url, _TurnLeft(tokenizer), tokenizer, cfg, http=http).run(items, h=2)
        assert httpx.get(f"{url}/health").json()["instances"] == 0
    assert [t.input_ids for t in result.trajectories] == [t.input_ids for t in runs["batched"].trajectories]
    # room for 4 of the 6: one request for those, one for the last 2 as the first pair ends; closed by the pair
    # that ends together (two pairs may end at once)
    assert (paths["/create_batch"], paths["/create"], paths["/close"]) == (2, 0, 0) and paths["/close_batch"] in (2, 3)


@pytest.mark.parametrize("mode", ["lockstep", "async"])
def test_replicas_share_the_trajectories_and_a_killed_one_loses_none(mode: str, tiny_policy) -> None:
    """Two BabyAI servers: the trajectories are spread by capacity and are exactly those of one server (same
    items, a policy that always acts); one SIGKILLed after the first round: its trajectories are rolled out again
    on the other, every trajectory is accounted for (valid, the lost attempts counted), none a silent zero."""
    tokenizer = tiny_policy[1]
    items = _items("babyai", 4)
    config = RolloutConfig(n_samples=2, max_new_tokens=12, seed=3, retries=1, backoff_s=0.05, mode=mode)
    with running_server("babyai") as first, running_server("babyai") as second:
        single = Rollout("babyai", first, _TurnLeft(tokenizer), tokenizer, config).run(items, h=3)
        shared = Rollout("babyai", [first, second], _TurnLeft(tokenizer), tokenizer, config).run(items, h=3)
        assert sorted(t.server for t in shared.trajectories) == [0] * 4 + [1] * 4
        assert [t.input_ids for t in shared.trajectories] == [t.input_ids for t in single.trajectories]
        assert all(len(t.turns) == 3 or t.termination == "done" for t in shared.trajectories)
        assert shared.stats["env/failed_attempts"] == 0

        victim = httpx.get(f"{second}/health").json()["pid"]
        engine = _TurnLeft(tokenizer, hook=lambda calls: os.kill(victim, signal.SIGKILL) if calls == 2 else None)
        rollout = Rollout("babyai", [first, second], engine, tokenizer, config)
        result = rollout.run(items, h=3)
        assert rollout.dead == {1}
        assert len(result.trajectories) == 8 and all(t.valid for t in result.trajectories)
        assert all(t.server == 0 for t in result.trajectories)
        # lock-step: the victim's 4 were all mid-rollout; async: any not reset yet move over with no lost attempt
        lost = len(result.failed_attempts)
        assert (lost == 4 if mode == "lockstep" else 1 <= lost <= 4) and result.stats["env/failed_attempts"] == lost
        assert all(t.termination == "env_error" for t in result.failed_attempts)
        assert sorted((t.group, t.sample) for t in result.trajectories) == [(g, s) for g in range(4) for s in range(2)]
        assert [t.input_ids for t in result.trajectories] == [t.input_ids for t in single.trajectories]
        assert httpx.get(f"{first}/health").json()["instances"] == 0


def test_a_phase_started_without_a_url_spreads_over_env_server_replicas(tiny_model_dir, tmp_path) -> None:
    """params.yaml env_server.replicas: run_phase starts that many servers, the rollout spreads over them (the
    rollout log says which held each trajectory), and all of them are stopped afterwards."""
    import psutil

    from training.phases.phase import run_phase
    from training.settings.config import ServerConfig, TrainConfig
    from training.settings.specs import PhaseSpec

    def servers() -> set[int]:  # this process's own (another xdist worker starts servers of its own meanwhile)
        return {p.pid for p in psutil.Process().children(recursive=True) if "envs.server" in " ".join(p.cmdline())}

    before = servers()
    train = TrainConfig(batch_items=2, n_samples=2, max_new_tokens=8, mini_batch_size=4, micro_batch_size=4,
                        sub_tasks=["GoTo"])
    spec = PhaseSpec(env="babyai", index=0, h=1, steps=1, init=tiny_model_dir, out=tmp_path / "p", train=train,
                     server=ServerConfig(replicas=2))
    run_phase(spec)
    rows = [json.loads(line) for line in (tmp_path / "p" / "rollouts" / "step-000000.jsonl").read_text().splitlines()]
    assert sorted(r["server"] for r in rows) == [0, 0, 1, 1]
    assert servers() <= before  # both replicas stopped
