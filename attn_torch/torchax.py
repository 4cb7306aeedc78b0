"""PyTorch models on TPU (or any JAX device) through torchax: attn_torch layers run as JAX.

torch-xla 2.9 is built against torch 2.9 and its pallas extra pins jax 0.7.1, so it cannot
share this project's pins (torch 2.11, jax 0.11.2); torchax (pinned 0.0.13, the ``xla``
extra) runs with both. Under torchax, torch tensors on device ``"jax"`` wrap JAX arrays
and torch ops run as JAX functions. ``enable()`` teaches torchax the one op attn_torch
adds, ``torch.ops.attn_stack.unified_attention``: it runs the layer's JAX ``Attention``
(``attn_jax.layer``) with the backend the selector picked for the process's platform
(PALLAS_TPU on a TPU, in its own cache layout; XLA on the CPU), jitted with the KV cache
donated. The cache is a JAX-owned array there, so the update is in place, and the bound
torchax tensor is re-pointed at the result (its Python object stays the same)::

    env = attn_torch.torchax.enable()
    with env:
        layer = attn_torch.Attention(8, 64, 64**-0.5, 2, prefix="l0")
        attn_torch.bind_kv_cache({"l0": layer.init_kv_cache(64, device="jax")})
        with attn_torch.set_forward_context(md):
            out = layer(q, k, v)            # q, k, v: torch tensors on device "jax"

No DLPack crossing happens on this path: the tensors already are JAX arrays. (This
module lives beside the layer it serves, not in ``bridge/``, which knows nothing of
attn_torch: DLPack and JAX's memory policy only.)

Importing torchax registers a "jax" device with torch; afterwards ``torch.compile`` in the
same process fails ("PyTorch is not linked with support for jax devices", torch 2.11 and
torchax 0.0.13), so keep torchax and torch.compile in separate processes (the tests do).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import torch

from attn_jax.metadata import CommonAttentionMetadata
from attn_torch.forward_context import get_forward_context
from attn_torch.ops import get_layer

__all__ = ["TORCHAX_VERSION", "enable"]

TORCHAX_VERSION = "0.0.13"
"""The torchax release tested with jax 0.11.2 and torch 2.11 (requirements/constraints.txt)."""


def _torchax():
    try:
        import torchax
    except ImportError as e:
        raise ImportError(
            f"attn_torch.torchax needs torchax=={TORCHAX_VERSION}: pip install 'attn-stack[xla]' "
            f"(or pip install torchax=={TORCHAX_VERSION}); torch-xla cannot share this project's jax and torch pins"
        ) from e
    return torchax


def enable(env=None):
    """Registers ``attn_stack::unified_attention`` with torchax; returns the env to enter.

    ``env`` defaults to ``torchax.default_env()``. Idempotent.
    """
    torchax = _torchax()
    env = torchax.default_env() if env is None else env
    env.override_op_definition(torch.ops.attn_stack.unified_attention.default, _unified_attention)
    return env


def _jax(x):
    from torchax import interop

    return interop.jax_view(x)


def _metadata_as_jax(md: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """Device fields as int32 arrays (torchax tensors unwrapped, NumPy kept for jit to transfer)."""
    fields = {}
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        value = getattr(md, name)
        if isinstance(value, torch.Tensor):
            value = _jax(value) if value.device.type == "jax" else value.detach().cpu().numpy()
        if np.dtype(value.dtype) != np.int32:
            raise ValueError(f"attn_metadata.{name} has dtype={value.dtype}; the torchax path takes int32 metadata")
        fields[name] = value
    return dataclasses.replace(md, **fields)


@functools.cache
def _donating_step(jax_layer):
    return jax.jit(jax_layer.__call__, donate_argnums=3)


def _unified_attention(query, key, value, layer_name):
    """torchax's implementation of the op: the layer's JAX Attention, cache donated and rebound."""
    from torchax import interop

    layer = get_layer(layer_name)
    ctx = get_forward_context()
    cache = layer.kv_cache[ctx.virtual_engine]
    if cache.numel() == 0:
        raise RuntimeError(
            f"Layer {layer_name!r} has no bound KV cache: bind one made with layer.init_kv_cache(num_blocks, "
            "device='jax')"
        )
    if cache.device.type != "jax" or query.device.type != "jax":
        raise ValueError(
            f"under torchax, query ({query.device}) and the KV cache ({cache.device}) must be on device 'jax'"
        )
    md = _metadata_as_jax(ctx.metadata_for(layer_name))
    jax_layer = layer._jax
    q, k, v, kv = (None if x is None else _jax(x) for x in (query, key, value, cache))
    out, new_cache = _donating_step(jax_layer)(q, k, v, kv, md)
    cache._elem = new_cache  # in place for whoever holds the bound tensor (the old buffer was donated)
    return interop.torch_view(out.reshape(query.shape))
