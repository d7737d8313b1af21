"""Training library: the ScalingInter curriculum (pure functions), the multi-turn rollout, policy engines
(hf, vllm), advantage estimators and losses, trainer backends (torch, deepspeed), checkpoints and metrics.
Nothing lives here yet: it arrives with the rollout/curriculum and trainer issues. Never imports Prefect
or DVC."""
