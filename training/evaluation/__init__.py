"""Evaluation and what is built on it: ``evaluate`` (held-out success and reward with intervals over items and
samples), ``eval_stage`` (the DVC stage ``<env>_eval``: every checkpoint of a run on the test split), ``gate``
(the promotion gates between phases: a phase against its parent on the gate split), ``report`` (the run's HTML
report) and ``lineage`` (each checkpoint's chain of parents, read from dvc.lock beside the manifests). They
sample through the rollouts and the engines and never change a policy's weights, except a gate's retry, which
trains the phase again through ``training.phases.phase``.
"""
