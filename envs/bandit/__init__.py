"""Bandit: a one-turn environment where one action pays. Not one of the paper's five: a fast, certain
signal for testing that the trainers learn (two arms; ``right`` pays 1, ``left`` pays 0)."""
