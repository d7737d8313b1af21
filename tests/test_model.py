"""The locally built tiny policy and the HF policy engine."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from training.engines.engine import HFEngine, SamplingParams
from training.model import build_tiny, load_policy

CORPUS = ["Thought: I need planks.\nAction: craft 4 oak planks using 1 oak logs", "Got 1 oak logs",
          "Your goal: go to the red ball\nThere is a red ball 1 2 steps in front of you.", "héllo wörld 42"] * 20


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_build_is_deterministic_given_seed_and_corpus(tmp_path) -> None:
    a, b, c = (build_tiny(CORPUS, tmp_path / name, seed=s) for name, s in (("a", 0), ("b", 0), ("c", 1)))
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    assert _digest(a)["tokenizer.json"] == _digest(c)["tokenizer.json"]


def test_saved_folder_is_a_normal_hf_qwen2_model(tiny_model_dir, tiny_policy) -> None:
    model, tokenizer = tiny_policy
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 1e7  # a few million parameters
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("text", [*CORPUS[:4], "  two  spaces\n\n\nnewlines\ttab", "<|im_start|>user\nhi<|im_end|>"])
def test_auto_tokenizer_gives_the_trained_ids(tiny_model_dir, text: str) -> None:
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"))
    assert auto(text)["input_ids"] == raw(text)["input_ids"]
    assert auto.decode(auto(text)["input_ids"]) == text


def test_chat_template_marks_exactly_the_assistant_turns(tiny_policy) -> None:
    tokenizer = tiny_policy[1]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Action: inventory"},
                {"role": "user", "content": "Inventory: empty"}]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(marked) == "Action: inventory<|im_end|>"


def test_hub_presets_load_through_the_same_code() -> None:  # offline here: the error names the hub id
    with pytest.raises(OSError, match=r"Qwen/Qwen2\.5-3B-Instruct"):
        load_policy("qwen2.5-3b-instruct")
    with pytest.raises(ValueError, match="build-model --preset tiny"):
        load_policy("tiny")
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        load_policy("no-such-model")


def test_engine_batches_with_left_padding_like_single_prompts(tiny_policy) -> None:
    model, tokenizer = tiny_policy
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompts = [tokenizer(t)["input_ids"] for t in ("Got 1 oak logs", "Your goal: go to the red ball", "hi")]
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    batched = engine.generate(prompts, greedy)
    single = [engine.generate([p], greedy)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    for prompt, g in zip(prompts, batched, strict=True):
        assert len(g.token_ids) == len(g.logprobs) <= 12
        assert g.finished == (g.token_ids[-1] == tokenizer.eos_token_id)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + g.token_ids])).logits[0]
        recomputed = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, len(prompt) + len(g.token_ids) - 1),
                                                   torch.tensor(g.token_ids)]
        assert torch.allclose(recomputed, torch.tensor(g.logprobs), atol=1e-4)


def test_engine_sampling_is_seeded_and_stops_at_end_of_turn(tiny_policy) -> None:
    model, tokenizer = tiny_policy
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompts = [tokenizer("Got 1 oak logs")["input_ids"]] * 4
    first = engine.generate(prompts, SamplingParams(max_new_tokens=20, seed=3))
    again = engine.generate(prompts, SamplingParams(max_new_tokens=20, seed=3))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert len({tuple(g.token_ids) for g in first}) > 1  # sampling, not greedy
    for g in first:
        assert tokenizer.eos_token_id not in g.token_ids[:-1]
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def _conversation(engine: HFEngine, params: SamplingParams, turns: int = 4, diverge: int | None = None
                  ) -> list[list]:
    """Six conversations of ``turns`` turns, each turn's prompt its last prompt, its reply and a new observation;
    at turn ``diverge`` the first conversation loses its first tokens (as the context clamp drops them)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 400) for _ in range(rng.randrange(40, 160))] for _ in range(6)]
    out = []
    for turn in range(turns):
        if turn == diverge:
            prompts[0] = prompts[0][10:]
        gens = engine.generate(prompts, dataclasses.replace(params, seed=turn))
        out.append(gens)
        prompts = [p + g.token_ids + [rng.randrange(5, 400) for _ in range(rng.randrange(10, 60))]
                   for p, g in zip(prompts, gens, strict=True)]
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_cache_gives_the_whole_prefills_tokens_and_logprobs(tiny_policy, temperature: float) -> None:
    model, tokenizer = tiny_policy
    params = SamplingParams(max_new_tokens=12, temperature=temperature)
    plain = _conversation(HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id), params, diverge=2)
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, prefix_cache_gb=0.5)
    cached = _conversation(engine, params, diverge=2)
    for turn_plain, turn_cached in zip(plain, cached, strict=True):
        assert [g.token_ids for g in turn_cached] == [g.token_ids for g in turn_plain]
        for a, b in zip(turn_plain, turn_cached, strict=True):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    cache = engine.prefix_cache
    # every later turn continues its conversation's cached sequence, but the one whose start was dropped (whose
    # old entry stays until the budget drops it)
    assert (cache.hits, cache.misses) == (6 * 3 - 1, 6 + 1)
    assert cache.reused_tokens > 0 and len(cache.entries) == 7


def test_prefix_cache_is_emptied_when_the_weights_change(tiny_policy) -> None:
    model, tokenizer = tiny_policy
    model = copy.deepcopy(model)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, prefix_cache_gb=0.5)
    prompt = tokenizer("Your goal: go to the red ball")["input_ids"]
    first = engine.generate([prompt], params)[0]
    follow = prompt + first.token_ids + tokenizer("There is a red ball 1 2 steps in front of you.")["input_ids"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model.train()
    model(torch.tensor([follow]), labels=torch.tensor([follow])).loss.backward()
    optimizer.step()
    model.eval()
    after = engine.generate([follow], params)[0]
    assert engine.prefix_cache.hits == 0  # the KV of the old weights was dropped, not reused
    fresh = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id).generate([follow], params)[0]
    assert after.token_ids == fresh.token_ids and after.logprobs == fresh.logprobs


def test_prefix_cache_keeps_to_its_budget(tiny_policy) -> None:
    model, tokenizer = tiny_policy
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, prefix_cache_gb=1e-3)  # ~1 MB
    _conversation(engine, SamplingParams(max_new_tokens=12, temperature=0), turns=2)
    cache = engine.prefix_cache
    assert 0 < len(cache.entries) < 6 and cache.nbytes <= cache.max_bytes
    assert cache.nbytes == sum(e.nbytes for e in cache.entries.values())


def test_committed_corpus_covers_every_environment_and_builds_the_same_model_twice(tmp_path) -> None:
    """build-model reads the recorded corpus, not live episodes: two builds are bitwise equal."""
    from typer.testing import CliRunner

    from envs.corpus import CORPUS_FILE, read_corpus
    from envs.paths import project_root
    from envs.registry import SERVED, spec_class
    from flows.cli import app

    texts = read_corpus(project_root() / CORPUS_FILE)
    for env in SERVED:  # each environment's instruction is in it
        assert spec_class(env).conversation_start[0]["value"] in texts, env
    assert any("OBSERVATION:" in t for t in texts) and any("<information>" in t for t in texts)
    runner = CliRunner()
    for name in ("a", "b"):
        done = runner.invoke(app, ["build-model", "--out", str(tmp_path / name),
                                   "--corpus", str(project_root() / CORPUS_FILE)])
        assert done.exit_code == 0, done.output
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")


def test_a_missing_or_broken_corpus_is_named(tmp_path) -> None:
    from typer.testing import CliRunner

    from envs.corpus import read_corpus, write_corpus
    from flows.cli import app

    path = write_corpus(["one", "two"], tmp_path / "c.json.gz")
    assert read_corpus(path) == ["one", "two"]
    first = path.read_bytes()
    assert write_corpus(["one", "two"], path).read_bytes() == first  # byte-reproducible
    (tmp_path / "bad.json.gz").write_text("not gzip")
    with pytest.raises(ValueError, match="build-corpus"):
        read_corpus(tmp_path / "bad.json.gz")
    done = CliRunner().invoke(app, ["build-model", "--out", str(tmp_path / "m"), "--corpus", str(tmp_path / "no.gz")])
    assert done.exit_code == 2 and "build-corpus" in done.output and not (tmp_path / "m").exists()
