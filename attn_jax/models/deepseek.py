"""A DeepSeek-V2/V3-shaped decoder in JAX whose attention runs through ``attn_jax.MLAAttention``.

Each block: RMSNorm, multi-head latent attention (the query straight from ``q_proj`` or
through the ``q_a_proj -> RMSNorm -> q_b_proj`` LoRA when ``q_lora_rank`` is set; the latent
``kv_a_proj_with_mqa -> [c_kv | k_pe]``, ``c_kv`` RMS-normalised; RoPE on ``q_pe`` and the
shared ``k_pe``, interleaved pairs as DeepSeek's checkpoints lay them out when
``rope_interleave``; any of ``llama.ROPE_TYPES``, YaRN's ``mscale_all_dim`` scaling the softmax
as DeepSeek does), ``o_proj``, RMSNorm, a SwiGLU MLP, or from layer ``first_k_dense_replace`` on
a mixture of experts. Its router (``ROUTERS``): DeepSeek-V3's sigmoid with a score-correction
bias picking ``num_experts_per_tok`` routed experts from the ``topk_group`` best of ``n_group``
groups (a group scored by its two best experts, ``noaux_tc``), or DeepSeek-V2's softmax over
all experts (``greedy``) or over the ``topk_group`` groups of best single experts
(``group_limited_greedy``); the chosen weights normalised (``norm_topk_prob``) and scaled by
``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts as one SwiGLU MLP. The
cache holds one latent row ``[c_kv | k_pe]`` per token and layer.

The routed experts run as grouped matmuls (``jax.lax.ragged_dot``): the step's
(token, expert) pairs sorted by expert, each expert's rows multiplied by its weights only,
so the expert FLOPs are ``num_experts_per_tok`` per token, not ``n_routed_experts``; no
expert parallelism across devices yet. The step interface is ``LlamaModel``'s, so
``attn_jax.serving.Engine`` serves it. A checkpoint folder loads through
``attn_jax.models.hf_checkpoint.load_hf_checkpoint`` (``model_type`` ``deepseek_v2`` /
``deepseek_v3``; its ``deepseek_config`` reads a ``config.json`` dict).

Example::

    config = deepseek_config(hf_model.config.to_dict())  # attn_jax.models.hf_checkpoint
    params = params_from_hf(hf_model)
    model = DeepSeekModel(config, block_size=16)
    caches = model.init_kv_caches(num_blocks=64)
    logits, caches = model.step(params, caches, token_ids, positions, common_attn_metadata, last_rows)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.metadata import CommonAttentionMetadata
from attn_jax.mla_layer import MLAAttention
from attn_jax.models.base import AttentionGroup
from attn_jax.models.llama import ROPE_TYPES, rms_norm, rope_frequencies

_HIGHEST = jax.lax.Precision.HIGHEST

ROUTERS = {"sigmoid": ("noaux_tc",), "softmax": ("greedy", "group_limited_greedy")}
"""``scoring_func`` -> its ``topk_method`` values: DeepSeek-V3's, DeepSeek-V2's."""


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
    rope_type: str = "default"  # one of llama.ROPE_TYPES, computed by llama.rope_frequencies
    rope_scaling_factor: float = 1.0
    rope_parameters: tuple[tuple[str, float], ...] = ()  # the type's other keys (llama.ROPE_PARAMETERS), sorted
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
    scoring_func: str = "sigmoid"  # with topk_method, one of ROUTERS
    topk_method: str = "noaux_tc"

    def is_moe_layer(self, i: int) -> bool:
        return self.first_k_dense_replace is not None and i >= self.first_k_dense_replace

    def rope_parameter(self, name: str, default: float | None = None) -> float | None:
        """One of ``rope_parameters`` (``default`` when absent): ``llama.rope_frequencies``' reader."""
        return dict(self.rope_parameters).get(name, default)

    @property
    def num_kv_heads(self) -> int:
        """1: every head reads the one latent row per token (MQA-like; ``make_mesh``'s count)."""
        return 1

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``mscale**2`` for a scaled RoPE with ``mscale_all_dim``
        (transformers' ``yarn_apply_mscale``)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        m = self.rope_parameter("mscale_all_dim")
        if self.rope_type != "default" and m and self.rope_scaling_factor > 1:
            scale *= (0.1 * m * np.log(self.rope_scaling_factor) + 1.0) ** 2
        return scale

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
        if self.topk_method not in ROUTERS.get(self.scoring_func, ()):
            raise ValueError(
                f"scoring_func={self.scoring_func!r} with topk_method={self.topk_method!r} is not supported; "
                f"supported: {ROUTERS}"
            )
        if self.first_k_dense_replace is not None and (
            self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group
        ):
            raise ValueError(
                f"n_routed_experts={self.n_routed_experts} must split into n_group={self.n_group} equal groups, "
                f"topk_group={self.topk_group} of them at most"
            )
        if self.first_k_dense_replace is not None and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"n_routed_experts={self.n_routed_experts}"
            )


def assemble_params(config: DeepSeekConfig, get: Callable[[str, tuple[int, ...]], np.ndarray], dtype) -> dict:
    """The model's params from a checkpoint's tensors: ``get(name, shape)`` returns the tensor
    ``name`` (Hugging Face's names and [out, in] layout, the routed experts one by one as
    DeepSeek's checkpoints store them: ``mlp.experts.{e}.gate_proj.weight``...) of that shape.

    Returns weights in ``x @ w`` layout (NumPy, ``dtype``; the router and its bias float32):
    per layer attn_norm, ffn_norm, q_proj or q_a_proj / q_a_norm / q_b_proj, kv_a_proj,
    kv_a_norm, kv_b_proj, o_proj, w_gate / w_up / w_down (the dense MLP or the shared
    experts) and on MoE layers router f32[E, D], router_bias f32[E] (sigmoid routers only),
    experts_gate / experts_up [E, D, I], experts_down [E, I, D]."""
    c = config
    qk, dim = c.qk_nope_head_dim + c.qk_rope_head_dim, c.hidden_size

    def vec(name, size):
        return get(name, (size,)).astype(dtype)

    def mat(name, out, inp):  # [out, in] stored, [in, out] returned
        return np.ascontiguousarray(get(name, (out, inp)).T).astype(dtype)

    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "attn_norm": vec(p + "input_layernorm.weight", dim),
            "ffn_norm": vec(p + "post_attention_layernorm.weight", dim),
            "kv_a_proj": mat(p + "self_attn.kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, dim),
            "kv_a_norm": vec(p + "self_attn.kv_a_layernorm.weight", c.kv_lora_rank),
            "kv_b_proj": mat(
                p + "self_attn.kv_b_proj.weight", c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank
            ),
            "o_proj": mat(p + "self_attn.o_proj.weight", dim, c.num_heads * c.v_head_dim),
        }
        if c.q_lora_rank is None:
            layer["q_proj"] = mat(p + "self_attn.q_proj.weight", c.num_heads * qk, dim)
        else:
            layer["q_a_proj"] = mat(p + "self_attn.q_a_proj.weight", c.q_lora_rank, dim)
            layer["q_a_norm"] = vec(p + "self_attn.q_a_layernorm.weight", c.q_lora_rank)
            layer["q_b_proj"] = mat(p + "self_attn.q_b_proj.weight", c.num_heads * qk, c.q_lora_rank)
        mlp, inter = p + "mlp.", c.intermediate_size
        if c.is_moe_layer(i):
            experts, inter = range(c.n_routed_experts), c.moe_intermediate_size
            layer["router"] = get(mlp + "gate.weight", (c.n_routed_experts, dim)).astype(np.float32)
            if c.scoring_func == "sigmoid":
                layer["router_bias"] = get(mlp + "gate.e_score_correction_bias", (c.n_routed_experts,))
                layer["router_bias"] = layer["router_bias"].astype(np.float32)
            for key, proj, out, inp in (
                ("gate", "gate", inter, dim),
                ("up", "up", inter, dim),
                ("down", "down", dim, inter),
            ):
                layer[f"experts_{key}"] = np.stack(
                    [mat(f"{mlp}experts.{e}.{proj}_proj.weight", out, inp) for e in experts]
                )
            mlp, inter = mlp + "shared_experts.", c.moe_intermediate_size * c.n_shared_experts
        layer["w_gate"] = mat(mlp + "gate_proj.weight", inter, dim)
        layer["w_up"] = mat(mlp + "up_proj.weight", inter, dim)
        layer["w_down"] = mat(mlp + "down_proj.weight", dim, inter)
        layers.append(layer)
    params = {
        "embed": get("model.embed_tokens.weight", (c.vocab_size, dim)).astype(dtype),
        "final_norm": vec("model.norm.weight", dim),
        "layers": layers,
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = mat("lm_head.weight", c.vocab_size, dim)
    return params


_EXPERT = re.compile(r"(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def params_from_hf(hf_model, config: DeepSeekConfig, dtype=np.float32) -> dict:
    """A transformers DeepseekV3ForCausalLM's (or V2's) weights, ``assemble_params``' layout:
    its state dict's fused experts (``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I])
    read as the checkpoint's per-expert tensors."""
    sd = {k: v.detach().float().cpu().numpy() for k, v in hf_model.state_dict().items()}

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        match = _EXPERT.fullmatch(name)
        if match is None:
            tensor = sd[name]
        elif match[3] == "down":
            tensor = sd[match[1] + ".down_proj"][int(match[2])]
        else:
            gate_up = sd[match[1] + ".gate_up_proj"][int(match[2])]  # [2I, D]
            tensor = np.split(gate_up, 2)[match[3] == "up"]
        assert tensor.shape == shape, (name, tensor.shape, shape)
        return tensor

    return assemble_params(config, get, dtype)


def rope(x, positions, inv_freq, scaling: float, interleave: bool):
    """x f[T, H, R] rotated at i32[T] positions by ``llama.rope_frequencies``' f32[R/2]
    ``inv_freq``, cos and sin times ``scaling`` (YaRN's attention factor). ``interleave``:
    pairs (x0, x1), (x2, x3), ... each rotated by one frequency, written out as [evens'
    results | odds' results] (Hugging Face's ``apply_rotary_pos_emb_interleave``; V2's complex
    product writes the pairs in place, the same scores as q and k move alike); else
    ``rotate_half`` RoPE."""
    dim = x.shape[-1]
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]  # f32[T, R/2]
    cos, sin = jnp.cos(freqs)[:, None, :] * scaling, jnp.sin(freqs)[:, None, :] * scaling
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def route(x, router, bias, c: DeepSeekConfig):
    """(i32[T, k] experts, f32[T, k] weights) of each token: x f[T, D], router f32[E, D],
    bias f32[E] or None. As transformers' ``DeepseekV3TopkRouter`` (sigmoid scores, the bias
    added for the choice only, groups scored by their two best) or ``DeepseekV2TopkRouter``
    (softmax scores; ``greedy`` over all experts, ``group_limited_greedy`` within the groups of
    the best single experts)."""
    logits = jnp.dot(x.astype(jnp.float32), jnp.asarray(router).T, precision=_HIGHEST)
    scores = jax.nn.sigmoid(logits) if c.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + jnp.asarray(bias)
    if c.topk_method != "greedy":
        per_group = c.n_routed_experts // c.n_group
        grouped = choice.reshape(-1, c.n_group, per_group)
        if c.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(grouped, min(2, per_group))[0].sum(axis=-1)  # f32[T, n_group]
        else:
            group_scores = grouped.max(axis=-1)
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
    idx, weights = route(x, w["router"], w.get("router_bias"), c)
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
        self.inv_freq, self.rope_scaling = rope_frequencies(c, dim=c.qk_rope_head_dim)  # f32[R/2], float
        self.attn = MLAAttention(
            c.num_heads, c.softmax_scale, c.qk_nope_head_dim, c.qk_rope_head_dim,
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
            pe = (positions, self.inv_freq, self.rope_scaling, c.rope_interleave)
            k_pe = rope(latent[:, None, c.kv_lora_rank :], *pe)[:, 0]
            q_pe = rope(q[..., nope:], *pe)
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
