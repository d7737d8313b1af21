"""What a run is told: the settings models read from params.yaml and phases.yaml (``config``), the doors from those
settings to one typed spec per stage kind (``specs``), where a run's files go (``layout``), the ScalingInter
schedule of turn caps (``curriculum``, pure functions) and the warm-start stages' settings (``warm``). Nothing here
loads a model or samples; every stage reads its settings through this package.
"""
