"""Warm starts: what trains a policy before the RL phases. ``sft`` (supervised fine-tuning on expert or recorded
episodes), ``rft`` (rejection sampling: sample, keep the successes, SFT), ``dpo`` (the policy's own successes
against its failures) and ``methods`` (one stage run as the pipeline and the CLI run it). A stage's settings
(``method: sft | rft | dpo`` in a curriculum profile's ``warm_start``) are ``training.settings.warm``'s models,
beside the other settings (``training.settings.config`` reads them).
"""
