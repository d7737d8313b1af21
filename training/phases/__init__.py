"""An RL phase as it runs: ``trainer`` (``PhaseTrainer``, set up in named steps, one step = sample, score, update),
``phase`` (one DVC stage's typed function), ``phase_save`` and ``phase_files`` (the checkpoints a phase writes and
reads back), ``data`` (the items it trains on, resumable to a position), ``mixed`` (a run over several environments)
and ``metrics`` (per-step metrics with dvclive).
"""
