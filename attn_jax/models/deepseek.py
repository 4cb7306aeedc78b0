"""A DeepSeek-V2/V3-shaped decoder in JAX whose attention runs through ``attn_jax.MLAAttention``.

Each block: RMSNorm, multi-head latent attention (the query straight from ``q_proj`` or
through the ``q_a_proj -> RMSNorm -> q_b_proj`` LoRA when ``q_lora_rank`` is set; the latent
``kv_a_proj_with_mqa -> [c_kv | k_pe]``, ``c_kv`` RMS-normalised; RoPE on ``q_pe`` and the
shared ``k_pe``, interleaved pairs as DeepSeek's checkpoints lay them out when
``rope_interleave``), ``o_proj``, RMSNorm, a SwiGLU MLP, or from layer ``first_k_dense_replace`` on DeepSeek-V3's
mixture of experts: a sigmoid router with a score-correction bias picks ``num_experts_per_tok``
routed experts from the ``topk_group`` best of ``n_group`` groups (a group scored by its two
best experts), their weights normalised (``norm_topk_prob``) and scaled by
``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts as one SwiGLU MLP. The
cache holds one latent row ``[c_kv | k_pe]`` per token and layer.

The routed experts run as grouped matmuls (``jax.lax.ragged_dot``): the step's
(token, expert) pairs sorted by expert, each expert's rows multiplied by its weights only,
so the expert FLOPs are ``num_experts_per_tok`` per token, not ``n_routed_experts``; no
expert parallelism across devices yet. YaRN RoPE scaling is not implemented. The step interface is ``LlamaModel``'s,
so ``attn_jax.serving.Engine`` serves it.

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
    first_k_dense_replace: int | None = None  # None: every layer's MLP is dense
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    def is_moe_layer(self, i: int) -> bool:
        return self.first_k_dense_replace is not None and i >= self.first_k_dense_replace

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    @classmethod
    def from_hf(cls, hf_config) -> DeepSeekConfig:
        """From a transformers DeepseekV3Config (or V2's); ValueError naming what is not supported."""
        c = hf_config
        first_dense = getattr(c, "first_k_dense_replace", c.num_hidden_layers)
        moe = {}
        if first_dense < c.num_hidden_layers:
            if c.n_routed_experts % c.n_group or c.topk_group > c.n_group:
                raise ValueError(
                    f"n_routed_experts={c.n_routed_experts} must split into n_group={c.n_group} equal groups, "
                    f"topk_group={c.topk_group} of them at most"
                )
            moe = dict(
                first_k_dense_replace=first_dense, n_routed_experts=c.n_routed_experts,
                num_experts_per_tok=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                n_shared_experts=c.n_shared_experts, moe_intermediate_size=c.moe_intermediate_size,
                routed_scaling_factor=float(c.routed_scaling_factor), norm_topk_prob=bool(c.norm_topk_prob),
            )  # fmt: skip
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
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,), **moe,
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
        }
        if p + "mlp.gate.weight" in sd:  # a mixture of experts
            inter = hf_model.config.moe_intermediate_size
            gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, D]
            layer |= {
                "router": sd[p + "mlp.gate.weight"].astype(np.float32),  # [E, D], used in f32
                "router_bias": sd[p + "mlp.gate.e_score_correction_bias"].astype(np.float32),
                "experts_gate": np.ascontiguousarray(gate_up[:, :inter].transpose(0, 2, 1)).astype(dtype),  # [E, D, I]
                "experts_up": np.ascontiguousarray(gate_up[:, inter:].transpose(0, 2, 1)).astype(dtype),
                "experts_down": np.ascontiguousarray(sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1)).astype(dtype),
                "w_gate": t(p + "mlp.shared_experts.gate_proj.weight"),
                "w_up": t(p + "mlp.shared_experts.up_proj.weight"),
                "w_down": t(p + "mlp.shared_experts.down_proj.weight"),
            }
        else:
            layer |= {
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


def route(x, router, bias, c: DeepSeekConfig):
    """(i32[T, k] experts, f32[T, k] weights) of each token, DeepSeek-V3's router as
    transformers' ``DeepseekV3TopkRouter``: x f[T, D], router f32[E, D], bias f32[E]."""
    per_group = c.n_routed_experts // c.n_group
    scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), jnp.asarray(router).T, precision=_HIGHEST))
    choice = scores + jnp.asarray(bias)
    grouped = choice.reshape(-1, c.n_group, per_group)
    group_scores = jax.lax.top_k(grouped, min(2, per_group))[0].sum(axis=-1)  # f32[T, n_group]
    keep = jax.nn.one_hot(jax.lax.top_k(group_scores, c.topk_group)[1], c.n_group).sum(axis=1) > 0
    choice = jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf)
    idx = jax.lax.top_k(choice, c.num_experts_per_tok)[1]  # i32[T, k]
    weights = jnp.take_along_axis(scores, idx, axis=1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
    return idx, weights * c.routed_scaling_factor


def moe(x, w, c: DeepSeekConfig):
    """f[T, D]: the routed experts (grouped matmuls over the (token, expert) pairs sorted by
    expert, weighted by ``route``) plus the shared ones."""
    k = c.num_experts_per_tok
    idx, weights = route(x, w["router"], w["router_bias"], c)
    flat = idx.reshape(-1)  # i32[T * k]
    order = jnp.argsort(flat, stable=True)
    token = order // k  # the token of each sorted pair
    sizes = jnp.bincount(flat, length=c.n_routed_experts).astype(jnp.int32)

    def grouped(a, experts):  # a f[T * k, in] sorted by expert; experts [E, in, out]
        return jax.lax.ragged_dot(a, jnp.asarray(experts).astype(a.dtype), sizes, precision=_HIGHEST)

    rows = x[token]
    hidden = jax.nn.silu(grouped(rows, w["experts_gate"])) * grouped(rows, w["experts_up"])
    out = grouped(hidden, w["experts_down"]) * weights.reshape(-1)[order][:, None].astype(x.dtype)
    routed = jnp.zeros_like(x).at[token].add(out)
    return routed + swiglu(x, w)


def _dot(x, w):
    """``x @ w`` in x's dtype at full precision (w a weight array, cast to x's dtype)."""
    return jnp.dot(x, jnp.asarray(w).astype(x.dtype), precision=_HIGHEST)


def swiglu(x, w):
    """f[T, D]: ``down(silu(x @ gate) * (x @ up))`` with the layer's w_gate, w_up, w_down."""
    return _dot(jax.nn.silu(_dot(x, w["w_gate"])) * _dot(x, w["w_up"]), w["w_down"])


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
        new_caches = []
        for i, (w, cache) in enumerate(zip(params["layers"], kv_caches, strict=True)):
            x = rms_norm(h, w["attn_norm"], c.rms_norm_eps)
            if c.q_lora_rank is None:
                q = _dot(x, w["q_proj"])
            else:
                q = _dot(rms_norm(_dot(x, w["q_a_proj"]), w["q_a_norm"], c.rms_norm_eps), w["q_b_proj"])
            q = q.reshape(num_tokens, c.num_heads, qk)
            latent = _dot(x, w["kv_a_proj"])  # f[T, C + R]
            kv_c = rms_norm(latent[:, : c.kv_lora_rank], w["kv_a_norm"], c.rms_norm_eps)
            k_pe = rope(latent[:, None, c.kv_lora_rank :], positions, c.rope_theta, c.rope_interleave)[:, 0]
            q_pe = rope(q[..., nope:], positions, c.rope_theta, c.rope_interleave)
            q = jnp.concatenate([q[..., :nope], q_pe], axis=-1)
            o, cache = self.attn(q, kv_c, k_pe, cache, attn_metadata, jnp.asarray(w["kv_b_proj"]).astype(self.dtype))
            h = h + _dot(o, w["o_proj"])
            x = rms_norm(h, w["ffn_norm"], c.rms_norm_eps)
            h = h + (moe(x, w, c) if c.is_moe_layer(i) else swiglu(x, w))
            new_caches.append(cache)
        h = rms_norm(h[logits_rows], params["final_norm"], c.rms_norm_eps)
        head = params.get("lm_head")
        logits = _dot(h, jnp.asarray(params["embed"]).T) if head is None else _dot(h, head)
        return logits.astype(jnp.float32), new_caches
