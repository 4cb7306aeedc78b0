"""``attn_torch.MLAAttention``: vLLM's MLA layer as a torch.nn.Module over attn-stack's MLA backends.

A thin torch shell around ``attn_jax.mla_layer.MLAAttention`` (same selector, same backends),
used like ``attn_torch.Attention``: metadata from ``set_forward_context``, the cache bound
with ``bind_kv_cache``::

    mla = MLAAttention(16, 192**-0.5, 128, 64, 128, None, 512, kv_b_proj=model.kv_b_proj, prefix="l0.mla")
    bind_kv_cache({"l0.mla": mla.init_kv_cache(num_blocks=64)})
    with set_forward_context(common_attn_metadata):
        out = mla(q, kv_c_normed, k_pe)   # q [T, H, 192], kv_c_normed [T, 512], k_pe [T, 64] -> [T, H * 128]

Per call: ``[kv_c_normed | k_pe]`` is written into the torch latent cache in place, then q,
the cache (one zero-copy view per bound tensor) and ``kv_b_proj``'s weight cross to JAX
zero-copy (``bridge.dlpack``), the backend's jitted impl runs (absorbed decodes,
up-projected prefills), and the output crosses back. Eager only: no ``torch.compile``
custom op yet.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import torch
from torch import nn

from attn_jax.layer import CacheConfig
from attn_jax.mla_layer import MLAAttention as JaxMLAAttention
from attn_torch import ops
from attn_torch.forward_context import get_forward_context
from bridge.dlpack import SUPPORTED_DTYPES, BridgeError, to_jax, to_torch

__all__ = ["MLAAttention"]

_unnamed = itertools.count()
_TORCH_OF_NP = {v: k for k, v in SUPPORTED_DTYPES.items()}


class MLAAttention(nn.Module):
    """Multi-head latent attention over a paged latent cache ``[P, S, kv_lora_rank + rope]``.

    Arguments are vLLM's ``MLAAttention``'s: ``kv_b_proj`` is the ``nn.Linear`` (or its weight
    f[H * (nope + v), kv_lora_rank]) whose halves are W_UK / W_UV; ``quant_config`` must be None.
    """

    def __init__(
        self,
        num_heads: int,
        scale: float,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        kv_b_proj: nn.Linear | torch.Tensor,
        cache_config: CacheConfig | None = None,
        quant_config=None,
        prefix: str = "",
        use_sparse: bool = False,
        attn_backend=None,
        *,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise NotImplementedError("quant_config: attn_torch has no quantised-checkpoint support; pass None")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in SUPPORTED_DTYPES or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"Unsupported activation dtype={dtype}. Valid dtypes are: float32, bfloat16, float16")
        self.layer_name = prefix or f"attn_torch.MLAAttention.{next(_unnamed)}"
        self._jax = JaxMLAAttention(
            num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank, kv_lora_rank,
            cache_config, self.layer_name, use_sparse, attn_backend, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, dtype=SUPPORTED_DTYPES[dtype],
        )  # fmt: skip
        self.kv_b_proj = kv_b_proj
        self.dtype = dtype
        self.attn_backend, self.impl = self._jax.attn_backend, self._jax.impl
        self.num_heads, self.v_head_dim = num_heads, v_head_dim
        self.kv_lora_rank, self.head_size = kv_lora_rank, self._jax.head_size
        self.kv_sharing_target_layer_name = None
        self.kv_cache: list[torch.Tensor] = [torch.tensor([])]
        self._cache_view: tuple[torch.Tensor, int, jax.Array] | None = None
        ops.register_layer(self.layer_name, self)
        impl = self.impl

        def step(q, kv_cache, md, kv_b_weight):
            w_uk, w_uv = self._jax.split_kv_b_proj(kv_b_weight.T.astype(q.dtype))
            out, _ = impl.forward(q, None, None, kv_cache, md, w_uk=w_uk, w_uv=w_uv)
            return out

        self._step = jax.jit(step)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        jax_dtype = self.attn_backend.kv_cache_dtype_for(self._jax.kv_cache_dtype, SUPPORTED_DTYPES[self.dtype])
        return _TORCH_OF_NP[jax_dtype]

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return tuple(self._jax.kv_cache_shape(num_blocks))

    def init_kv_cache(self, num_blocks: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A zero latent cache tensor for ``num_blocks`` pages."""
        return torch.zeros(self.kv_cache_shape(num_blocks), dtype=self.kv_cache_torch_dtype, device=device)

    def check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """ValueError unless ``kv_cache`` is a contiguous [num_blocks, block_size, C + R] tensor of the cache dtype."""
        shape = self.kv_cache_shape(1)
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != shape[1:]:
            got = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
            raise ValueError(
                f"kv_cache {got} for layer {self.layer_name!r} must be [num_blocks, {shape[1]}, {shape[2]}]"
            )
        if kv_cache.dtype != self.kv_cache_torch_dtype:
            raise ValueError(f"kv_cache.dtype={kv_cache.dtype} for layer {self.layer_name!r}: expected "
                             f"{self.kv_cache_torch_dtype}")  # fmt: skip
        if not kv_cache.is_contiguous():
            raise BridgeError(f"kv_cache for layer {self.layer_name!r} must be contiguous (written in place, read "
                              "zero-copy)")  # fmt: skip

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, output_shape=None):
        """q [T, H, nope + rope] or [T, H * (nope + rope)]; kv_c_normed [T, C]; k_pe [T, R] or [T, 1, R].
        Returns [T, H * v_head_dim] (or ``output_shape``) in q's dtype."""
        ctx = get_forward_context()
        kv_cache = self.kv_cache[ctx.virtual_engine]
        if kv_cache.numel() == 0:
            raise RuntimeError(
                f"Layer {self.layer_name!r} has no bound KV cache: call attn_torch.bind_kv_cache("
                f"{{{self.layer_name!r}: layer.init_kv_cache(num_blocks)}}) before the forward pass"
            )
        num_tokens = q.shape[0]
        for name, x in (("q", q), ("kv_c_normed", kv_c_normed), ("k_pe", k_pe)):
            if x.dtype != self.dtype:
                raise TypeError(f"{name}.dtype={x.dtype} must be the layer's dtype={self.dtype} (no silent cast)")
            if x.device != kv_cache.device:
                raise BridgeError(f"{name} is on {x.device} but the layer's cache is on {kv_cache.device}")
        prepared = ctx.prepare(self.layer_name, self._jax.metadata_builder, kv_cache.device,
                               num_blocks=kv_cache.shape[0])  # fmt: skip
        if num_tokens != prepared.num_tokens:
            raise ValueError(f"q has {num_tokens} token rows but the forward context's slot_mapping has "
                             f"{prepared.num_tokens}: pad the activations to the metadata's num_tokens")  # fmt: skip
        latent = torch.cat([kv_c_normed, k_pe.reshape(num_tokens, -1)], dim=-1).to(kv_cache.dtype)
        if prepared.write_rows is not None:
            latent = latent[prepared.write_rows]
        else:
            latent = latent[: prepared.write_slots.shape[0]]
        kv_cache.view(-1, kv_cache.shape[-1])[prepared.write_slots] = latent  # in place
        view = self._cache_view
        if view is None or view[0] is not kv_cache or view[1] != kv_cache.data_ptr():
            self.check_kv_cache(kv_cache)
            view = self._cache_view = (kv_cache, kv_cache.data_ptr(), to_jax(kv_cache, name="kv_cache"))
        weight = self.kv_b_proj.weight if isinstance(self.kv_b_proj, nn.Linear) else self.kv_b_proj
        q3 = q.reshape(num_tokens, self.num_heads, -1).contiguous()
        out = self._step(to_jax(q3, name="q"), view[2], prepared.backend_metadata,
                         to_jax(weight.detach().contiguous(), name="kv_b_proj.weight"))  # fmt: skip
        out = to_torch(jnp.asarray(out), name="MLA output")
        return out.reshape(output_shape or (num_tokens, self.num_heads * self.v_head_dim))

    def extra_repr(self) -> str:
        return f"prefix={self.layer_name!r}, {self._jax!r}"
