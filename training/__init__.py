"""Training library, by concept: ``settings/`` (the settings models, one typed spec per stage kind, the run layout,
the ScalingInter curriculum as pure functions), ``placement/`` (devices and the distributed strategy),
``rollouts/`` (multi-turn episodes), ``engines/`` (who generates a reply: transformers' ``generate``, a vLLM server
kept in sync, a chat API; ``sampler`` builds one), ``rl/`` (advantage estimators, losses, the update), ``phases/``
(the trainer, a phase's stage, its checkpoints, data and metrics), ``warmstart/`` (SFT, RFT, DPO) and
``evaluation/`` (evaluation, promotion gates, report, lineage); the model, LoRA, checkpoints, trajectories, the
preflight and the guard are modules of their own. What each DVC stage does is one typed function
(``model.build_base``, ``phases.phase``, ``evaluation.eval_stage``, ``evaluation.report``), so the stage's command
and the Prefect flow run the same code. Never imports Prefect or DVC (an import contract in pyproject.toml,
checked by the tests)."""
