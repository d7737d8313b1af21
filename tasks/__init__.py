"""Prefect tasks, kept thin: provision environment servers, run one curriculum phase (its DVC stage),
evaluate, version and push artifacts. They call into ``training``, ``envs`` and DVC's command line and
hold no algorithm code."""
