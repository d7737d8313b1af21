"""The RL update: ``advantages`` (GRPO's group baseline, GAE, REINFORCE++ and the rest, per token), ``losses``
(the clipped policy loss, its aggregation over tokens, KL estimators, entropy), ``critic`` (PPO's value head),
``experience`` (trajectories into one padded training batch with its masks) and ``update`` (the optimizer steps
over that batch, mixed into ``training.phases.trainer.PhaseTrainer``). Nothing here samples, evaluates or knows the
stages: the import contracts keep the rollouts, the evaluation and the pipeline out of this package.
"""
