"""Multi-turn rollouts: ``rollout`` (episodes of an environment server played by a policy engine, turn by
turn, under a turn cap and a context budget), ``rollout_instances`` (the pool of server instances an episode
holds, with retries and failover) and ``rollout_async`` (episodes played concurrently). A turn is recorded by
``training.trajectory``; replies are formatted by ``training.chat_format``. Nothing here trains or evaluates.
"""
