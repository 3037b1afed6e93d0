"""Public API and registries."""

import pytest

from verl_mega.algorithms import Registry, get_adv_estimator, get_kl_estimator, get_policy_loss_fn


@pytest.mark.parametrize(
    "getter, known",
    [
        (get_adv_estimator, ["gae", "grpo", "rloo", "reinforce_plus_plus"]),
        (get_policy_loss_fn, ["vanilla"]),
        (get_kl_estimator, ["k1", "k2", "k3", "low_var_kl"]),
    ],
)
def test_unknown_registry_name_raises_value_error_listing_known_names(getter, known):
    with pytest.raises(ValueError) as excinfo:
        getter("no_such_name")
    message = str(excinfo.value)
    assert "no_such_name" in message
    for name in known:
        assert name in message


def test_registry_aliases_share_one_function_and_duplicates_are_refused():
    registry = Registry("thing")

    @registry.register("a", "b")
    def fn():
        return 7

    assert registry.get("a") is registry.get("b") is fn
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(lambda: 0)
