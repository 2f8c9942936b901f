"""`check_ppo_under_deepspeed`: the PPO options DeepSpeed cannot honour fail at construction with the fix named."""

import logging
from types import SimpleNamespace

import pytest

from trl_ext.trainers.common.checks import check_ppo_under_deepspeed


def _accelerator(zero_stage=None):
    plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))


def _args(freezing_actor_steps=0, ds3_gather_for_generation=True):
    return SimpleNamespace(
        freezing_actor_steps=freezing_actor_steps, ds3_gather_for_generation=ds3_gather_for_generation
    )


def test_freezing_the_actor_under_deepspeed_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="use freezing_actor_steps=0"):
        check_ppo_under_deepspeed(_args(freezing_actor_steps=2), _accelerator(2), is_deepspeed_enabled=True)
    check_ppo_under_deepspeed(_args(freezing_actor_steps=2), _accelerator(), is_deepspeed_enabled=False)  # fine


@pytest.mark.parametrize(("stage", "gather", "warns"), [(3, False, True), (3, True, False), (2, False, False)])
def test_zero3_without_gathered_generation_warns(caplog, stage, gather, warns):
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.common.checks"):
        check_ppo_under_deepspeed(_args(ds3_gather_for_generation=gather), _accelerator(stage), True)
    assert ("ds3_gather_for_generation=True" in caplog.text) is warns
