"""attn-stack for PyTorch: vLLM's Attention layer over the same backends as attn_jax.

Importing ``attn_torch`` imports ``bridge`` first, which sets
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` before JAX initialises (unless you chose a JAX
memory policy yourself), so JAX allocates GPU memory on demand and leaves room for
PyTorch. Public names: ``Attention``, ``MLAAttention``, ``bind_kv_cache``, ``set_forward_context``,
``get_forward_context``, ``write_to_kv_cache`` and, re-exported from attn_jax,
``CacheConfig`` and ``build_common_attn_metadata``. ``import attn_torch.ops`` registers
``torch.ops.attn_stack.unified_attention`` (done here).
"""

# isort: off
import bridge  # noqa: F401  (first: sets JAX's GPU memory policy before JAX initialises)

# isort: on
from attn_jax.layer import CacheConfig
from attn_jax.metadata import CommonAttentionMetadata, build_common_attn_metadata
from attn_torch.forward_context import ForwardContext, get_forward_context, set_forward_context
from attn_torch.kv_cache import write_to_kv_cache
from attn_torch.layer import Attention, bind_kv_cache
from attn_torch.mla_layer import MLAAttention

__all__ = [
    "Attention",
    "CacheConfig",
    "CommonAttentionMetadata",
    "ForwardContext",
    "MLAAttention",
    "bind_kv_cache",
    "build_common_attn_metadata",
    "get_forward_context",
    "set_forward_context",
    "write_to_kv_cache",
]
