"""Benchmarks (``make bench`` runs them all: ``benchmarks/run_all.py``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_MODEL = ROOT / "models" / "tiny"


def tiny_model(path: str | Path | None = None) -> Path:
    """The policy a benchmark runs: ``path``, else the project's ``models/tiny``, built there as ``scalinginter
    build-model`` builds it (seed 0, the recorded corpus) when a fresh clone has none. Any other ``path`` that is
    not a model folder is an error naming what to do."""
    if path is not None and Path(path).resolve() != PROJECT_MODEL:
        if not (Path(path) / "config.json").exists():
            raise SystemExit(f"{path}: not a model folder (no config.json); build one with "
                             "`scalinginter build-model --out PATH`, or use the default models/tiny")
        return Path(path)
    if not (PROJECT_MODEL / "config.json").exists():
        from envs.corpus import read_corpus
        from training.model import build_tiny

        build_tiny(read_corpus(ROOT / "data" / "tokenizer_corpus.json.gz"), PROJECT_MODEL, seed=0)
    return PROJECT_MODEL
