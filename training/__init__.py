"""Training library: settings (``config``), the run layout, the ScalingInter curriculum (pure functions), the
multi-turn rollout, the policy engines (transformers' ``generate``; a vLLM server kept in sync), advantage
estimators and losses, the trainer and its strategies (torch, DeepSpeed), checkpoints, metrics, evaluation and
SFT, and what each DVC stage does as one typed function (``model.build_base``, ``phase``, ``eval_stage``,
``report``; ``lineage`` reads dvc.lock beside the manifests), so the stage's command and the Prefect flow run the
same code. Never imports Prefect or DVC (an import contract in pyproject.toml, checked by the tests)."""
