"""Training library, by concept: settings (``config``, ``specs``: one typed spec per stage kind), the run layout
(``layout``), the ScalingInter curriculum (``curriculum``, pure functions), ``rollouts/`` (multi-turn episodes),
``engines/`` (who generates a reply: transformers' ``generate``, a vLLM server kept in sync, a chat API), ``rl/``
(advantage estimators, losses, the update), the trainer (``trainer``, ``sampler``, ``phase_save``) and its
strategies (torch, DeepSpeed), checkpoints, ``warmstart/`` (SFT, RFT, DPO) and ``evaluation/`` (evaluation,
promotion gates, report, lineage). What each DVC stage does is one typed function (``model.build_base``,
``phase``, ``evaluation.eval_stage``, ``evaluation.report``), so the stage's command and the Prefect flow run the
same code. Never imports Prefect or DVC (an import contract in pyproject.toml, checked by the tests)."""
