"""Training library: settings (``config``), the run layout, the ScalingInter curriculum (pure functions), the
multi-turn rollout, the policy engines (transformers' ``generate``; a vLLM server kept in sync), advantage
estimators and losses, the trainer and its strategies (torch, DeepSpeed), checkpoints, metrics, evaluation and
SFT. Never imports Prefect or DVC (an import contract in pyproject.toml, checked by the tests)."""
