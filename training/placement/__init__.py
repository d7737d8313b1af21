"""Where a run's tensors live: ``devices`` (the device resolved once, from ``SCALINGINTER_DEVICE`` and the local
rank, CUDA or Ascend NPU) and ``strategy`` (single process, DDP or DeepSpeed ZeRO across ranks).
"""
