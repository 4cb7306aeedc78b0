"""The Attention layer for JAX models: vLLM's constructor, a functional call.

The layer holds static hyperparameters only. The KV cache and the batch metadata are
passed in and the updated cache is returned, so a model step can be jitted with the
cache donated::

    layer = Attention(num_heads=8, head_size=64, scale=64**-0.5, num_kv_heads=2)
    kv_cache = layer.init_kv_cache(num_blocks=128)
    step = jax.jit(layer.__call__, donate_argnums=3)
    out, kv_cache = step(q, k, v, kv_cache, common_attn_metadata)
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.backends.base import AttentionBackend, AttentionSpec
from attn_jax.kv_cache import allocate_kv_cache, calc_kv_scales
from attn_jax.metadata import CommonAttentionMetadata
from attn_jax.ops.ragged_paged_attention.validate import checkify_validate_inputs, is_concrete
from attn_jax.platforms import current_platform
from attn_jax.registry import AttentionBackendEnum
from attn_jax.selector import get_attn_backend
from attn_jax.types import (
    AttentionType,
    is_quantized_kv_cache,
    validate_activation_dtype,
    validate_cache_dtype,
    validate_positive_finite,
    validate_positive_int,
    validate_sliding_window,
    validate_soft_cap,
)

logger = logging.getLogger(__name__)


_debug_checks = False


def set_debug_checks(enabled: bool) -> None:
    """Turns the checked mode on or off for every later trace of an ``Attention`` layer.

    With it on, a layer called on traced metadata (inside ``jax.jit``) states the dynamic
    metadata checks (lengths consistent, block ids a request uses in range, slots in range:
    those that run on the host for concrete metadata) as ``jax.experimental.checkify``
    checks, which the caller functionalizes::

        attn_jax.set_debug_checks(True)
        err, (out, kv_cache) = checkify.checkify(jax.jit(layer.__call__))(q, k, v, kv_cache, md)
        err.throw()  # JaxRuntimeError naming the first bad value

    A step jitted without ``checkify.checkify`` then fails at trace time (never runs
    unchecked). Off (the default), jitted code carries no checks. Already-compiled
    functions keep the mode they were traced with.
    """
    global _debug_checks
    _debug_checks = bool(enabled)


def debug_checks_enabled() -> bool:
    """Whether ``set_debug_checks(True)`` is in effect."""
    return _debug_checks


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Model-wide cache settings (the subset of vLLM's CacheConfig attention reads)."""

    block_size: int = 16
    cache_dtype: str = "auto"
    sliding_window: int | None = None
    calculate_kv_scales: bool = False


class Attention:
    """Attention layer: writes new k/v to the paged cache and attends (MHA/GQA/MQA).

    Arguments follow vLLM's ``Attention``; ``dtype`` is the activation dtype used for
    backend selection (default: JAX's default float). The backend is chosen by
    ``get_attn_backend`` unless ``attn_backend`` is given.

    ``query_quant=True`` (FP8 attention; vLLM's ``query_quant``, which vLLM turns on by itself
    for an fp8 cache on FA3; opt-in here, since it changes an fp8-cache layer's numerics):
    with ``kv_cache_dtype`` "fp8" / "fp8_e4m3", the query is quantised per tensor to e4m3 with
    the static ``layer.q_scale`` (vLLM's ``_q_scale``: 1.0 until ``calc_kv_scales`` or a
    checkpoint sets it), both dots run e4m3 x e4m3 with float32 accumulation (the softmax
    weights quantised for ``p @ v``) and the output keeps the activation dtype. Backends
    without ``supports_quant_query_input`` refuse it with a reason.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes=None,
        cache_config: CacheConfig | None = None,
        logits_soft_cap: float | None = None,
        per_layer_sliding_window: int | None = None,
        use_mla: bool = False,
        use_sparse: bool = False,
        prefix: str = "",
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        attn_backend: type[AttentionBackend] | None = None,
        *,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        sinks=None,
        dtype=None,
        attention_chunk_size: int | None = None,
        query_quant: bool = False,
    ) -> None:
        if use_mla:
            raise NotImplementedError(
                "use_mla=True: MLA layers are attn_jax.mla_layer.MLAAttention (they take the latent c_kv and k_pe)"
            )
        if use_sparse:
            raise NotImplementedError("use_sparse=True: no attn-stack backend implements sparse attention yet")
        num_heads = validate_positive_int("num_heads", num_heads)
        head_size = validate_positive_int("head_size", head_size)
        num_kv_heads = num_heads if num_kv_heads is None else validate_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads!r}")
        if kv_sharing_target_layer_name is not None and kv_sharing_target_layer_name == prefix:
            raise ValueError(f"kv_sharing_target_layer_name={prefix!r} names this layer itself")

        calculate_kv_scales = False
        sliding_window = None
        if cache_config is not None:
            block_size = cache_config.block_size
            kv_cache_dtype = cache_config.cache_dtype
            sliding_window = cache_config.sliding_window
            calculate_kv_scales = cache_config.calculate_kv_scales
        if per_layer_sliding_window is not None:
            sliding_window = per_layer_sliding_window
        block_size = validate_positive_int("block_size", block_size)
        validate_cache_dtype(kv_cache_dtype)
        sliding_window = validate_sliding_window(sliding_window)
        scale = validate_positive_finite("scale", scale, "the softmax scale, usually head_size**-0.5")
        logits_soft_cap = validate_soft_cap(logits_soft_cap)
        if attention_chunk_size is not None:
            attention_chunk_size = validate_positive_int("attention_chunk_size", attention_chunk_size)
            if attention_chunk_size % block_size:
                raise ValueError(
                    f"attention_chunk_size={attention_chunk_size} must be a positive multiple of "
                    f"block_size={block_size}"
                )
        if dtype is None and jnp.zeros(()).dtype == jnp.float64:
            raise TypeError(
                "dtype=None means JAX's default float, which is float64 with jax_enable_x64 on; attention runs "
                "in float32, bfloat16 or float16: pass dtype= (e.g. dtype=jnp.float32)"
            )

        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.calculate_kv_scales = calculate_kv_scales
        self.layer_name = prefix
        self.attn_type = AttentionType.parse(attn_type)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.use_mla = use_mla
        self.use_sparse = use_sparse
        self.has_sink = sinks is not None
        self.has_alibi = alibi_slopes is not None
        self.logits_soft_cap = logits_soft_cap
        self.dtype = validate_activation_dtype(jnp.zeros(()).dtype if dtype is None else dtype)
        # vLLM's defaults: 1.0, overwritten by calc_kv_scales or a checkpoint's scales.
        self.k_scale = jnp.float32(1.0)
        self.v_scale = jnp.float32(1.0)
        self.q_scale = jnp.float32(1.0)  # the query's per-tensor scale under query_quant (vLLM's _q_scale)
        self.query_quant = bool(query_quant)
        fp8_query = {"query_quant": True} if self.query_quant else {}  # backends written before it take none

        if attn_backend is None:
            attn_backend = get_attn_backend(
                head_size, self.dtype, kv_cache_dtype, block_size, use_mla=use_mla,
                has_sink=self.has_sink, use_sparse=use_sparse, attn_type=self.attn_type, **fp8_query,
            )  # fmt: skip
        else:
            if isinstance(attn_backend, AttentionBackendEnum):  # a registry name as well as its class
                attn_backend = attn_backend.get_class()
            reasons = attn_backend.validate_configuration(
                head_size, self.dtype, kv_cache_dtype, block_size, use_mla=use_mla,
                has_sink=self.has_sink, use_sparse=use_sparse, attn_type=self.attn_type,
                platform=current_platform(), **fp8_query,
            )  # fmt: skip
            if reasons:
                name = attn_backend.get_name()
                raise ValueError(f"attn_backend={name} cannot serve this layer: " + "; ".join(reasons))
        self.attn_backend = attn_backend
        self.impl = attn_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            kv_cache_dtype, logits_soft_cap, self.attn_type, kv_sharing_target_layer_name,
            sinks=sinks,
        )  # fmt: skip
        self.kv_cache_spec = AttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=self.dtype,
            sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size,
            num_q_heads=num_heads,
            cache_dtype=attn_backend.kv_cache_dtype_for(kv_cache_dtype, self.dtype),
            query_quant=self.query_quant,
        )
        self.metadata_builder = attn_backend.get_builder_cls()(self.kv_cache_spec)

    def prepare(self, attn_metadata: CommonAttentionMetadata):
        """The backend's metadata for one batch, built on the host from concrete (NumPy)
        ``CommonAttentionMetadata``: what the engine passes into its jitted step.

        Passing ``CommonAttentionMetadata`` into ``jax.jit(layer.__call__)`` builds it
        traced instead, from shapes alone (PALLAS_GPU: batch mode and Mosaic GPU split
        chosen from the bucket, BENCHMARKS.md measures both ways); one host build serves
        every layer of a step that shares this layer's configuration.
        """
        if not isinstance(attn_metadata, CommonAttentionMetadata):
            raise TypeError(f"prepare takes CommonAttentionMetadata, not {type(attn_metadata).__name__}")
        return self.metadata_builder.build(0, attn_metadata)

    def init_kv_cache(self, num_blocks: int, fill: float = 0.0) -> jax.Array:
        """A zero-filled cache of the backend's shape and dtype for ``num_blocks`` pages."""
        return allocate_kv_cache(
            self.attn_backend, num_blocks, self.block_size, self.num_kv_heads, self.head_size,
            self.kv_cache_dtype, self.dtype, fill=fill,
        )  # fmt: skip

    def write_to_kv_cache(self, kv_cache, key, value, slot_mapping):
        """Writes key/value [T, Hkv*D] or [T, Hkv, D] at slot_mapping i32[T] into this layer's
        cache, in its backend's layout and with the layer's k/v scales (cross-attention's
        encoder keys and values). Returns the cache."""
        k, v = self._heads("key", key, self.num_kv_heads), self._heads("value", value, self.num_kv_heads)
        self._check_kv_cache(kv_cache)
        return self.attn_backend.write_to_kv_cache(
            kv_cache, k, v, slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale
        )

    def calc_kv_scales(self, query, key, value) -> None:
        """Sets q/k/v scales from the abs max of concrete inputs (once, like vLLM)."""
        self.q_scale, self.k_scale, self.v_scale = calc_kv_scales(query, key, value)
        self.calculate_kv_scales = False

    def __call__(self, query, key, value, kv_cache, attn_metadata):
        """query [T, Hq*D] or [T, Hq, D]; key, value [T, Hkv*D] or [T, Hkv, D] (None when
        sharing another layer's KV); kv_cache of the backend's shape; attn_metadata a
        ``CommonAttentionMetadata`` or the backend's own metadata.

        Cross-attention (``attn_type="encoder_decoder"``) takes key = value = None: the
        encoder's keys and values have their own token count, so the caller writes them
        once with ``layer.write_to_kv_cache(kv_cache, enc_k, enc_v, encoder_slot_mapping)`` and
        ``seq_lens`` holds each request's encoder length.

        Returns (output [T, Hq*D] in query's dtype, updated kv_cache).
        """
        if self.attn_type is AttentionType.ENCODER_DECODER and key is not None:
            raise ValueError(
                "attn_type='encoder_decoder' takes key=None and value=None: write the encoder's "
                "keys and values into the cache with layer.write_to_kv_cache(..., encoder_slot_mapping) first"
            )
        if self.calculate_kv_scales and is_quantized_kv_cache(self.kv_cache_dtype):
            if not is_concrete(query, key, value):
                raise ValueError(
                    "calculate_kv_scales=True: the scales come from the first batch's values; "
                    "call layer.calc_kv_scales(query, key, value) once outside jax.jit"
                )
            self.calc_kv_scales(query, key, value)
        num_blocks = self._check_kv_cache(kv_cache)
        self.check_inputs(query, key, value)
        num_tokens = query.shape[0]
        q = self._heads("query", query, self.num_heads)
        k = None if key is None else self._heads("key", key, self.num_kv_heads)
        v = None if value is None else self._heads("value", value, self.num_kv_heads)
        if isinstance(attn_metadata, CommonAttentionMetadata):
            attn_metadata = self.metadata_builder.build(0, attn_metadata)
        if _debug_checks:
            md = attn_metadata
            arrays = (md.query_start_loc, md.seq_lens, md.block_tables, md.slot_mapping)
            if not is_concrete(*arrays):  # concrete metadata gets the same checks on the host, in the op
                checkify_validate_inputs(
                    *arrays, num_blocks=num_blocks, block_size=self.block_size, causal=self.attn_type.is_causal
                )
        fp8_query = {"q_scale": self.q_scale} if self.query_quant else {}
        out, kv_cache = self.impl.forward(
            q, k, v, kv_cache, attn_metadata, k_scale=self.k_scale, v_scale=self.v_scale, **fp8_query
        )
        return out.reshape(num_tokens, self.num_heads * self.head_size), kv_cache

    def check_inputs(self, query, key, value, dtype_of=None) -> None:
        """The activation checks both layers (JAX and ``attn_torch``) run on every call:
        query has the layer's dtype (no silent cast: the backend was selected for it), key
        and value have query's dtype and one row per query row, or are both None.
        ``dtype_of(x)`` gives an array's NumPy dtype (default ``np.dtype(x.dtype)``)."""
        dtype_of = dtype_of or (lambda x: np.dtype(x.dtype))
        if (key is None) != (value is None):
            raise ValueError("key and value must both be given or both be None (None: a layer that writes no k/v)")
        q_dtype = dtype_of(query)
        if q_dtype != self.dtype:
            raise TypeError(
                f"query.dtype={q_dtype} but layer {self.layer_name!r} was built (and its backend selected) for "
                f"dtype={self.dtype}: cast the activations or build the layer with dtype={q_dtype}"
            )
        for name, x in (("key", key), ("value", value)):
            if x is None:
                continue
            if dtype_of(x) != q_dtype:
                raise TypeError(f"{name}.dtype={dtype_of(x)} must equal query.dtype={q_dtype}")
            if x.shape[0] != query.shape[0]:
                raise ValueError(
                    f"{name} has {x.shape[0]} token rows but query has {query.shape[0]}: key and value hold one "
                    "row per query row (padding rows included)"
                )

    def _check_kv_cache(self, kv_cache) -> int:
        """Its page count; ValueError / TypeError when ``kv_cache`` is not this layer's cache (any page count)."""
        backend = self.attn_backend
        want_dtype = backend.kv_cache_dtype_for(self.kv_cache_dtype, self.dtype)
        if np.dtype(kv_cache.dtype) != want_dtype:
            raise TypeError(
                f"kv_cache.dtype={np.dtype(kv_cache.dtype)} but this layer's cache holds {want_dtype} "
                f"(kv_cache_dtype={self.kv_cache_dtype!r}, dtype={self.dtype}); allocate it with layer.init_kv_cache"
            )
        dims = (self.block_size, self.num_kv_heads, self.head_size, self.kv_cache_dtype)
        one, two = backend.get_kv_cache_shape(1, *dims), backend.get_kv_cache_shape(2, *dims)
        pages_axis = next(i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b)
        shape = tuple(kv_cache.shape)
        mismatched = len(shape) != len(one) or any(
            s != e for i, (s, e) in enumerate(zip(shape, one, strict=True)) if i != pages_axis
        )
        if mismatched:
            expected = list(one)
            expected[pages_axis] = "num_blocks"
            raise ValueError(
                f"kv_cache.shape={shape} does not match this layer's {backend.get_name()} cache "
                f"{tuple(expected)} (block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size})"
            )
        return shape[pages_axis]

    def _heads(self, name: str, x, num_heads: int):
        """[T, H*D] or [T, H, D] -> [T, H, D], with an error naming the expected shapes."""
        if x.ndim == 3 and x.shape[1:] == (num_heads, self.head_size):
            return x
        if x.ndim == 2 and x.shape[1] == num_heads * self.head_size:
            return x.reshape(x.shape[0], num_heads, self.head_size)
        raise ValueError(
            f"{name}.shape={tuple(x.shape)} must be [T, {num_heads * self.head_size}] or "
            f"[T, {num_heads}, {self.head_size}] (num_heads={num_heads}, head_size={self.head_size})"
        )

    def get_attn_backend(self) -> type[AttentionBackend]:
        return self.attn_backend

    def __repr__(self) -> str:
        fields = [
            f"prefix={self.layer_name!r}",
            f"num_heads={self.num_heads}",
            f"num_kv_heads={self.num_kv_heads}",
            f"head_size={self.head_size}",
            f"scale={self.scale:.6g}",
            f"attn_type={self.attn_type.value!r}",
            f"backend={self.attn_backend.get_name()}",
            f"kv_cache_dtype={self.kv_cache_dtype!r}",
            f"block_size={self.block_size}",
        ]
        optional = {
            "sliding_window": self.sliding_window,
            "logits_soft_cap": self.logits_soft_cap,
            "attention_chunk_size": self.attention_chunk_size,
            "kv_sharing_target_layer_name": self.kv_sharing_target_layer_name,
        }
        fields += [f"{k}={v!r}" for k, v in optional.items() if v is not None]
        if self.has_alibi:
            fields.append("alibi=True")
        if self.has_sink:
            fields.append("sinks=True")
        if self.query_quant:
            fields.append("query_quant=True")
        return f"Attention({', '.join(fields)})"
