"""Prefect flows and deployments of the ScalingInter pipeline (``flows.scalinginter_flow``: one deployment per
environment, ``prefect.yaml``), the DVC pipeline they write and run (``flows.dvc_pipeline``), and the
``scalinginter`` command line (``flows.cli``).

Whatever enters through here (the command line, or a Prefect worker loading the flow) gets the same process
settings before transformers is imported: no tokenizer threads forked into the env-server and sampler workers,
and no transformers progress bar per checkpoint load and save ("Loading weights", "Writing model shards"), which
would fill the flow's log; the pipeline's own progress (rollouts, phases) stays. Setting either variable
beforehand wins (``HF_HUB_DISABLE_PROGRESS_BARS=0`` brings the bars back).
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
