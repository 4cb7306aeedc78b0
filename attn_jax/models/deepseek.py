"""A DeepSeek-V2/V3-shaped decoder in JAX whose attention runs through ``attn_jax.MLAAttention``.

Each block: RMSNorm, multi-head latent attention (the query straight from ``q_proj`` or
through the ``q_a_proj -> RMSNorm -> q_b_proj`` LoRA when ``q_lora_rank`` is set; the latent
``kv_a_proj_with_mqa -> [c_kv | k_pe]``, ``c_kv`` RMS-normalised; RoPE on ``q_pe`` and the
shared ``k_pe``, interleaved pairs as DeepSeek's checkpoints lay them out when
``rope_interleave``), ``o_proj``, RMSNorm, a SwiGLU MLP. The cache holds one latent row
``[c_kv | k_pe]`` per token and layer.

Every MLP is dense: the routed mixture of experts of layers past ``first_k_dense_replace``
is not implemented (``DeepSeekConfig`` refuses a config that would need it), so this serves
DeepSeek-shaped test models and dense MLA models; YaRN RoPE scaling is not implemented
either. The step interface is ``LlamaModel``'s, so ``attn_jax.serving.Engine`` serves it.

Example::

    config = DeepSeekConfig.from_hf(hf_model.config)
    params = params_from_hf(hf_model)
    model = DeepSeekModel(config, block_size=16)
    caches = model.init_kv_caches(num_blocks=64)
    logits, caches = model.step(params, caches, token_ids, positions, common_attn_metadata, last_rows)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.metadata import CommonAttentionMetadata
from attn_jax.mla_layer import MLAAttention
from attn_jax.models.base import AttentionGroup
from attn_jax.models.llama import rms_norm

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
    """Hyperparameters (Hugging Face's DeepseekV3Config names where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int = -1
    eos_token_ids: tuple[int, ...] = ()
    name: str = "deepseek"

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    @classmethod
    def from_hf(cls, hf_config) -> DeepSeekConfig:
        """From a transformers DeepseekV3Config (or V2's); ValueError naming what is not supported."""
        c = hf_config
        if getattr(c, "first_k_dense_replace", c.num_hidden_layers) < c.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace={c.first_k_dense_replace} < num_hidden_layers={c.num_hidden_layers}: "
                "layers past it are mixtures of experts, which DeepSeekModel does not implement (only dense MLPs)"
            )
        rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": c.rope_theta}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type={rope['rope_type']!r} is not supported (valid: 'default')")
        if getattr(c, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported (valid: False)")
        eos = c.eos_token_id
        return cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            q_lora_rank=c.q_lora_rank, rope_theta=float(rope["rope_theta"]),
            rope_interleave=bool(getattr(c, "rope_interleave", True)), rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=bool(c.tie_word_embeddings),
            bos_token_id=-1 if c.bos_token_id is None else c.bos_token_id,
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
        )  # fmt: skip


def params_from_hf(hf_model, dtype=np.float32) -> dict:
    """A transformers DeepseekV3ForCausalLM's weights in ``x @ w`` layout (NumPy)."""
    sd = {k: v.detach().float().cpu().numpy() for k, v in hf_model.state_dict().items()}

    def t(name):  # nn.Linear stores [out, in]
        return np.ascontiguousarray(sd[name].T).astype(dtype)

    layers = []
    for i in range(hf_model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            "attn_norm": sd[p + "input_layernorm.weight"].astype(dtype),
            "ffn_norm": sd[p + "post_attention_layernorm.weight"].astype(dtype),
            "kv_a_proj": t(p + "self_attn.kv_a_proj_with_mqa.weight"),
            "kv_a_norm": sd[p + "self_attn.kv_a_layernorm.weight"].astype(dtype),
            "kv_b_proj": t(p + "self_attn.kv_b_proj.weight"),
            "o_proj": t(p + "self_attn.o_proj.weight"),
            "w_gate": t(p + "mlp.gate_proj.weight"),
            "w_up": t(p + "mlp.up_proj.weight"),
            "w_down": t(p + "mlp.down_proj.weight"),
        }
        if hf_model.config.q_lora_rank is None:
            layer["q_proj"] = t(p + "self_attn.q_proj.weight")
        else:
            layer["q_a_proj"] = t(p + "self_attn.q_a_proj.weight")
            layer["q_a_norm"] = sd[p + "self_attn.q_a_layernorm.weight"].astype(dtype)
            layer["q_b_proj"] = t(p + "self_attn.q_b_proj.weight")
        layers.append(layer)
    params = {
        "embed": sd["model.embed_tokens.weight"].astype(dtype),
        "final_norm": sd["model.norm.weight"].astype(dtype),
        "layers": layers,
    }
    if not hf_model.config.tie_word_embeddings:
        params["lm_head"] = t("lm_head.weight")
    return params


def rope(x, positions, theta: float, interleave: bool):
    """x f[T, H, R] rotated at i32[T] positions. ``interleave``: pairs (x0, x1), (x2, x3), ...
    each rotated by one frequency, written out as [evens' results | odds' results] (Hugging
    Face's ``apply_rotary_pos_emb_interleave``); else ``rotate_half`` RoPE."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # f32[T, R/2]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class DeepSeekModel:
    """The decoder: static structure only; weights, caches and batches are arguments.

    Args:
      config: the model's hyperparameters.
      block_size: tokens per latent cache page.
      kv_cache_dtype: vLLM's cache dtype names ("auto" = the activation dtype).
      attn_backend: an MLA backend class; None lets the selector choose (``use_mla=True``).
      dtype: activation dtype (float32 default).
    """

    def __init__(self, config: DeepSeekConfig, *, block_size: int = 16, kv_cache_dtype: str = "auto",
                 attn_backend=None, dtype=jnp.float32) -> None:  # fmt: skip
        c = config
        self.config = config
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self.attn = MLAAttention(
            c.num_heads, (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim, c.q_lora_rank, c.kv_lora_rank, prefix="model.layers.*.self_attn.attn",
            attn_backend=attn_backend, block_size=block_size, kv_cache_dtype=kv_cache_dtype, dtype=self.dtype,
        )  # fmt: skip

    @property
    def attn_backend(self):
        return self.attn.attn_backend

    @property
    def attention_group(self) -> AttentionGroup:
        """Every layer's MLA attention: one backend, one metadata per step (``ServingModel``)."""
        names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(self.config.num_layers))
        return AttentionGroup(self.attn.attn_backend, self.attn.metadata_builder, self.block_size, names)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's latent cache shape: (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)."""
        return self.attn.kv_cache_shape(num_blocks)

    def init_kv_caches(self, num_blocks: int) -> list[jax.Array]:
        """Zero caches, one per layer."""
        return [self.attn.init_kv_cache(num_blocks) for _ in range(self.config.num_layers)]

    def step(self, params, kv_caches, token_ids, positions, attn_metadata, logits_rows):
        """One forward pass over a packed batch; returns (logits f32[N, vocab], kv_caches).

        ``LlamaModel.step``'s arguments: token_ids, positions i32[T]; attn_metadata a
        ``CommonAttentionMetadata`` (built here, on the host: call eagerly) or the backend's
        ``MLAMetadata`` (``build_for_jit``, for a jitted step); logits_rows i32[N].
        """
        c = self.config
        num_tokens = token_ids.shape[0]
        nope, qk = c.qk_nope_head_dim, c.qk_nope_head_dim + c.qk_rope_head_dim
        if isinstance(attn_metadata, CommonAttentionMetadata):
            attn_metadata = self.attn.metadata_builder.build(0, attn_metadata)  # once, not per layer
        h = jnp.asarray(params["embed"])[token_ids].astype(self.dtype)  # f[T, D]

        def dot(x, w):
            return jnp.dot(x, jnp.asarray(w).astype(x.dtype), precision=_HIGHEST)

        new_caches = []
        for w, cache in zip(params["layers"], kv_caches, strict=True):
            x = rms_norm(h, w["attn_norm"], c.rms_norm_eps)
            if c.q_lora_rank is None:
                q = dot(x, w["q_proj"])
            else:
                q = dot(rms_norm(dot(x, w["q_a_proj"]), w["q_a_norm"], c.rms_norm_eps), w["q_b_proj"])
            q = q.reshape(num_tokens, c.num_heads, qk)
            latent = dot(x, w["kv_a_proj"])  # f[T, C + R]
            kv_c = rms_norm(latent[:, : c.kv_lora_rank], w["kv_a_norm"], c.rms_norm_eps)
            k_pe = rope(latent[:, None, c.kv_lora_rank :], positions, c.rope_theta, c.rope_interleave)[:, 0]
            q_pe = rope(q[..., nope:], positions, c.rope_theta, c.rope_interleave)
            q = jnp.concatenate([q[..., :nope], q_pe], axis=-1)
            o, cache = self.attn(q, kv_c, k_pe, cache, attn_metadata, jnp.asarray(w["kv_b_proj"]).astype(self.dtype))
            h = h + dot(o, w["o_proj"])
            x = rms_norm(h, w["ffn_norm"], c.rms_norm_eps)
            h = h + dot(jax.nn.silu(dot(x, w["w_gate"])) * dot(x, w["w_up"]), w["w_down"])
            new_caches.append(cache)
        h = rms_norm(h[logits_rows], params["final_norm"], c.rms_norm_eps)
        head = params.get("lm_head")
        logits = dot(h, jnp.asarray(params["embed"]).T) if head is None else dot(h, head)
        return logits.astype(jnp.float32), new_caches
