"""The KV cache's budget on a device with memory statistics (faked here: the CPU has none)."""

from __future__ import annotations

import pytest

from attn_jax.serving import kv_cache_sizing
from attn_jax.serving.kv_cache_sizing import activation_bytes, kv_cache_plan
from attn_jax.testing.models import tiny_random_config

GIB = 2**30


@pytest.fixture
def device_memory(monkeypatch):
    """A device of 10 GiB with 2 GiB in use."""
    monkeypatch.setattr(
        kv_cache_sizing, "_memory_stats", lambda device: {"bytes_limit": 10 * GIB, "bytes_in_use": 2 * GIB}
    )


@pytest.mark.parametrize("on_device", [False, True])
def test_the_budget_takes_the_weights_once_and_the_runners_copy(device_memory, on_device):
    """Host weights are still to come; device ones are in use already, and only the runner's
    copy of some of them (its per-layer buffers) is still to come."""
    config = tiny_random_config(512)
    limits = dict(max_num_batched_tokens=64, max_rows=8, gpu_memory_utilization=0.5)
    plan = kv_cache_plan(config, params_bytes=GIB, params_on_device=on_device, copied_bytes=GIB // 4, **limits)
    act = activation_bytes(config, max_num_batched_tokens=64, max_rows=8)
    weights = GIB // 4 if on_device else GIB
    assert plan.kv_cache_bytes == 5 * GIB - 2 * GIB - weights - act
    assert plan.weights_bytes == GIB + GIB // 4 and plan.bytes_limit == 10 * GIB


def test_no_room_left_names_each_part(device_memory):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2 of 10.00 GiB, 2.00 GiB in use, weights 1.00 GiB"):
        kv_cache_plan(tiny_random_config(512), params_bytes=GIB, max_num_batched_tokens=64, max_rows=8,
                      gpu_memory_utilization=0.2, params_on_device=True, copied_bytes=GIB)  # fmt: skip
