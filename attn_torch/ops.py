"""``torch.ops.attn_stack.unified_attention``: attention as one opaque torch.library op.

``torch.compile`` sees the op through its fake (meta) implementation, which only says
the output's shape and dtype, so a compiled model keeps attention as one node and has no
graph break there; the real implementation runs eagerly, crossing to JAX through the
bridge. As in vLLM's ``unified_attention``, the layer is named by a string and the batch
metadata and KV cache are found through the forward context, so the op's schema holds
only tensors and the name::

    attn_stack::unified_attention(Tensor query, Tensor? key, Tensor? value, str layer_name) -> Tensor

query f[T, Hq, D]; key, value f[T, Hkv, D] or None (cross-attention, KV sharing);
returns f[T, Hq, D] in query's dtype. The op writes key/value into the layer's bound
cache (a hidden side effect, as in vLLM, where ``mutates_args=[]`` as well).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["get_layer", "register_layer", "unified_attention"]

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""layer name -> live attn_torch.Attention (vLLM's static_forward_context)."""


def register_layer(name: str, layer) -> None:
    """Makes ``layer`` reachable by name from the op; ValueError on a duplicate live name."""
    if name in _LAYERS:
        raise ValueError(f"Duplicate layer name: {name!r}; every attn_torch.Attention needs a distinct prefix")
    _LAYERS[name] = layer


def get_layer(name: str):
    """The live layer called ``name``; KeyError naming the registered ones."""
    try:
        return _LAYERS[name]
    except KeyError:
        raise KeyError(f"No attn_torch.Attention named {name!r}; registered: {sorted(_LAYERS)}") from None


def static_forward_context() -> dict:
    """A snapshot of every live layer by name (vLLM's ``static_forward_context``)."""
    return dict(_LAYERS)


@torch.library.custom_op("attn_stack::unified_attention", mutates_args=())
def unified_attention(
    query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_name: str
) -> torch.Tensor:
    """Writes key/value into ``layer_name``'s cache and attends; f[T, Hq, D]."""
    return get_layer(layer_name).attend(query, key, value)


@unified_attention.register_fake
def _unified_attention_fake(query, key, value, layer_name):
    return torch.empty_like(query, memory_format=torch.contiguous_format)
