"""Prefect tasks, kept thin: provision environment servers, bring each DVC stage up to date (data splits, base
model, warm start, curriculum phases, evaluation, report: in the flow's process when a stage is the only stale one,
else by ``dvc repro``), version and push artifacts. They call into ``training``, ``envs`` and DVC and hold no
algorithm code."""
