"""params.yaml -> validated trainer configs: Appendix B values in the paper profile, clear errors."""

from __future__ import annotations

import pytest

from training.settings.config import ConfigError, train_config


@pytest.mark.parametrize(("env", "lr", "n"), [("webarena", 5e-7, 4), ("deepsearch", 1e-6, 8), ("textcraft", 1e-6, 8),
                                              ("babyai", 1e-6, 8), ("sciworld", 1e-6, 8)])
def test_paper_profile_has_appendix_b_settings(env: str, lr: float, n: int) -> None:
    config = train_config(env, "paper")
    assert (config.lr, config.n_samples, config.kl_coef, config.temperature) == (lr, n, 1e-3, 1.0)
    assert config.algorithm == "grpo"


def test_overrides_win_and_bad_values_name_the_section() -> None:
    assert train_config("babyai", "smoke", {"lr": 0.5}).lr == 0.5
    with pytest.raises(ConfigError, match=r"train\.smoke .*lr"):
        train_config("babyai", "smoke", {"lr": -1})
    with pytest.raises(ConfigError, match="no_such_field"):
        train_config("babyai", "smoke", {"no_such_field": 1})
    with pytest.raises(ConfigError, match=r"train\.nope"):
        train_config("babyai", "nope")
