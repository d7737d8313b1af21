"""Prefect flows and deployments of the ScalingInter pipeline (one deployment per environment), and the
``scalinginter`` command line (``flows.cli``). The pipeline flow arrives with the orchestration issue."""
