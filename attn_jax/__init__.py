"""attn-stack for JAX: ragged paged attention behind a vLLM-style backend interface.

The public names of the contract in ARCHITECTURE.md; everything else is internal.
"""

__version__ = "0.1.0"

from attn_jax.backends.base import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, AttentionSpec
from attn_jax.kv_cache import allocate_kv_cache, calc_kv_scales, write_to_kv_cache
from attn_jax.layer import Attention, CacheConfig, debug_checks_enabled, set_debug_checks
from attn_jax.metadata import (
    CommonAttentionMetadata,
    MetadataBuckets,
    PerLayerParameters,
    build_common_attn_metadata,
    get_kv_cache_layout,
    get_per_layer_parameters,
    infer_global_hyperparameters,
    make_local_attention_virtual_batches,
    reorder_batch_to_split_decodes_and_prefills,
    set_kv_cache_layout,
    split_decodes_and_prefills,
    validate_common_metadata,
)
from attn_jax.mla_layer import MLAAttention
from attn_jax.ops.ragged_paged_attention.cascade import cascade_ragged_paged_attention
from attn_jax.ops.ragged_paged_attention.merge import merge_attn_states
from attn_jax.ops.ragged_paged_attention.reference import ragged_paged_attention
from attn_jax.platforms import Platform, current_platform
from attn_jax.registry import AttentionBackendEnum, MambaAttentionBackendEnum, register_backend
from attn_jax.selector import (
    SelectionReport,
    explain_attn_backend_selection,
    get_attn_backend,
    get_global_forced_attn_backend,
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
)
from attn_jax.types import AttentionType, CacheDType, KVCacheLayout

__all__ = [
    "__version__",
    "Attention",
    "MLAAttention",
    "AttentionBackend",
    "AttentionBackendEnum",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionType",
    "CacheConfig",
    "CacheDType",
    "CommonAttentionMetadata",
    "KVCacheLayout",
    "MambaAttentionBackendEnum",
    "MetadataBuckets",
    "PerLayerParameters",
    "Platform",
    "SelectionReport",
    "allocate_kv_cache",
    "build_common_attn_metadata",
    "calc_kv_scales",
    "current_platform",
    "debug_checks_enabled",
    "explain_attn_backend_selection",
    "get_attn_backend",
    "get_global_forced_attn_backend",
    "get_kv_cache_layout",
    "get_per_layer_parameters",
    "global_force_attn_backend",
    "global_force_attn_backend_context_manager",
    "infer_global_hyperparameters",
    "make_local_attention_virtual_batches",
    "ragged_paged_attention",
    "merge_attn_states",
    "cascade_ragged_paged_attention",
    "register_backend",
    "reorder_batch_to_split_decodes_and_prefills",
    "set_debug_checks",
    "set_kv_cache_layout",
    "split_decodes_and_prefills",
    "validate_common_metadata",
    "write_to_kv_cache",
]
