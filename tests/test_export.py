"""`scalinginter export`: a phase's checkpoint as a Hugging Face folder with its evaluation in the model card."""

from __future__ import annotations

import json

import pytest

from envs.splits import load_split
from flows.export import export_phase
from tests.test_trainer import CONFIG
from training.checkpoint import read_manifest
from training.evaluation.evaluate import evaluate_checkpoints
from training.phases.trainer import train_phase
from training.settings.config import ConfigError
from training.settings.layout import Run


def test_export_hands_on_the_model_with_its_evaluation(env_server, tiny_model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, url = Run("babyai", root=tmp_path), env_server("babyai")
    final = train_phase("babyai", 0, 1, 1, tiny_model_dir, run.phase(0), config=CONFIG, url=url)
    items = load_split("babyai", "test")[:2]
    metrics = evaluate_checkpoints({"phase-0": final}, "babyai", url, items, h=1, k=1, temperature=1.0,
                                   max_new_tokens=8, seed=0)
    metrics["checkpoints"]["phase-0"]["hash"] = read_manifest(final)["hash"]
    run.eval_dir.mkdir(parents=True)
    run.eval_metrics.write_text(json.dumps(metrics))

    out = export_phase("babyai", 0, tmp_path / "export", root=tmp_path)
    assert not list(out.glob("*.pt")) and (out / "scalinginter_manifest.json").exists()
    card = (out / "README.md").read_text()
    assert "## Evaluation (2 held-out items, k=1" in card and "| success |" in card and "turn cap h | 1 |" in card
    AutoModelForCausalLM.from_pretrained(out)  # a plain HF folder
    assert AutoTokenizer.from_pretrained(out).chat_template

    metrics["checkpoints"]["phase-0"]["hash"] = "another"  # an evaluation of another checkpoint is refused
    run.eval_metrics.write_text(json.dumps(metrics))
    with pytest.raises(ConfigError, match="evaluated another phase-0 checkpoint"):
        export_phase("babyai", 0, tmp_path / "again", root=tmp_path)
