"""Every duration and count key of the config has an upper bound, and its ValueError names the key and
the fix (docs/usage.md, "Every key: ranges, honoured, refused"): a value beyond it is a mistake, and for
``communication_timeout_s`` it would overflow ``datetime.timedelta`` on the way to the process groups."""
import datetime

import pytest

from deepspeed_acco.runtime.checks import MAX_COUNT, MAX_DURATION_S
from deepspeed_acco.runtime.comm import process_group_timeout_s
from deepspeed_acco.runtime.config import parse_config


@pytest.mark.parametrize("change, key", [
    ({"params": {"communication_timeout_s": 1e14}}, r"optimizer\.params\.communication_timeout_s: must be at most "
                                                     r"31,536,000 \(365 days\)"),
    ({"params": {"warmup_sync_updates": 2**40}}, r"optimizer\.params\.warmup_sync_updates: must be at most"),
    ({"params": {"sync_after_updates": 2**40}}, r"optimizer\.params\.sync_after_updates: must be at most"),
    ({"gradient_accumulation_steps": 2**40}, r"gradient_accumulation_steps: must be at most 2,147,483,647"),
    ({"train_micro_batch_size_per_gpu": 2**40}, r"train_micro_batch_size_per_gpu: must be at most"),
    ({"train_batch_size": 2**40}, r"train_batch_size: must be at most"),
    ({"steps_per_print": 2**40}, r"steps_per_print: must be at most"),
    ({"fp16": {"loss_scale_window": 2**40}}, r"fp16\.loss_scale_window: must be at most"),
    ({"fp16": {"hysteresis": 2**40}}, r"fp16\.hysteresis: must be at most"),
    ({"fp16": {"initial_scale_power": 2000}}, r"fp16\.initial_scale_power: must lie in \[0, 64\]"),
    ({"fp16": {"initial_scale_power": -1}}, r"fp16\.initial_scale_power: must lie in \[0, 64\]"),
    ({"type": "CO2", "params": {"local_steps": 2**40}}, r"optimizer\.params\.local_steps: must be at most"),
    ({"type": "CO2", "params": {"group_size": 2**40}}, r"optimizer\.params\.group_size: must be at most"),
])
def test_every_duration_and_count_key_has_an_upper_bound_named_in_its_error(change, key):
    change = dict(change)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": change.pop("type", "ACCO"), "params": change.pop("params", {})}}
    if "fp16" in change:
        config["fp16"] = {"enabled": True, **change.pop("fp16")}
    if "train_batch_size" in change:
        config.pop("train_micro_batch_size_per_gpu")
    config.update(change)
    with pytest.raises(ValueError, match=key) as raised:
        parse_config(config, 1)
    assert "; " in str(raised.value)  # the fix follows the problem


def test_the_bounds_themselves_are_accepted():
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "steps_per_print": MAX_COUNT,
              "fp16": {"enabled": True, "initial_scale_power": 64, "loss_scale_window": MAX_COUNT},
              "optimizer": {"type": "ACCO", "params": {"communication_timeout_s": MAX_DURATION_S,
                                                       "warmup_sync_updates": MAX_COUNT - 1,
                                                       "sync_after_updates": MAX_COUNT}}}
    parse_config(config, 1)
    # The largest accepted timeout still builds the datetime.timedelta the process groups get.
    datetime.timedelta(seconds=process_group_timeout_s(MAX_DURATION_S))
