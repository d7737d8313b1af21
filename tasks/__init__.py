"""Prefect tasks, kept thin: provision environment servers, run one curriculum phase at fixed h,
evaluate, version and push artifacts. They call into ``training`` and ``envs`` and hold no algorithm code.
Nothing lives here yet: the tasks arrive with the orchestration issue."""
