"""A Llama-family decoder in JAX whose attention runs through ``attn_jax.Attention``.

RMSNorm, RoPE (Hugging Face's rotate-half form, the model's theta; linear, Llama 3 and YaRN
scaling as transformers computes them, ``rope_frequencies``), GQA,
SwiGLU, tied embeddings when the checkpoint ties them, optional attention-projection
biases (Qwen2's q/k/v, Llama's ``attention_bias``), a sliding window (Mistral) or one per
layer, per-head q/k RMSNorm (Qwen3), and Gemma 2 / 3's switches (``LlamaConfig``: (1 + w)
norms, a scaled embedding, GeGLU, norms after attention and MLP, soft caps, a query scalar,
a second RoPE for the sliding layers). One
call, ``LlamaModel.step``, runs a packed, mixed prefill + decode batch: every request's
new tokens on one token axis, their keys and values written into a paged cache per
layer, attention by the layer's backend. The layers are unrolled over per-layer weights
(q/k/v and gate/up each fused into one matmul, ``fuse_params``) and per-layer caches (a
list): on the CPU, ``jax.lax.scan`` over stacked weights copies every layer's weights
out of the stack each step and runs about twice as slow; on a GPU XLA runs the scan's
iterations from the host, so a call returns only when its device work is enqueued
(``benchmarks/scan_layers.py``).

Example::

    config, params = load_gguf(gguf_path())
    model = LlamaModel(config, block_size=16)
    caches = model.init_kv_caches(num_blocks=256)
    logits, caches = jax.jit(model.step)(params, caches, token_ids, positions, attn_md, last_rows)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.layer import Attention
from attn_jax.metadata import CommonAttentionMetadata
from attn_jax.models.base import AttentionGroup
from attn_jax.types import validate_sliding_window

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama-family decoder (Hugging Face's names where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # the RoPE type's ``factor`` (linear: positions are divided by it)
    rope_type: str = "default"  # one of ROPE_TYPES (transformers' ``rope_type``)
    rope_parameters: tuple[tuple[str, float], ...] = ()  # the type's other keys (ROPE_PARAMETERS), sorted
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int = -1
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on the output projection (Llama's attention_bias)
    sliding_window: int | None = None  # every layer sees its last `sliding_window` keys (Mistral)
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    layer_sliding_windows: tuple[int | None, ...] = ()  # per layer (Gemma 2 / 3's layer_types); () = sliding_window
    # Gemma 2 / 3: norms scale by (norm_offset + weight) in float32; the embedding is multiplied
    # by embed_scale; the MLP's gate activation; sandwich_norms adds a norm after attention and
    # after the MLP (layer_norms [L, 4, H]); soft caps on attention scores and final logits;
    # attn_scale replaces head_dim**-0.5 (query_pre_attn_scalar**-0.5); sliding layers' RoPE
    # theta (Gemma 3's rope_local_base_freq, default RoPE), the other layers' being rope_*.
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    attn_scale: float | None = None
    local_rope_theta: float | None = None
    # Each KV head stored this many times in a row (``sharding.replicate_kv_heads``: a model
    # axis larger than the KV heads gives each shard a copy of the one its queries read).
    kv_head_copies: int = 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        validate_sliding_window(self.sliding_window)
        if self.layer_sliding_windows:
            if len(self.layer_sliding_windows) != self.num_layers or self.sliding_window is not None:
                raise ValueError(
                    f"layer_sliding_windows={self.layer_sliding_windows} must give one window per layer "
                    f"(num_layers={self.num_layers}) with sliding_window=None, not {self.sliding_window}"
                )
            for window in self.layer_sliding_windows:
                validate_sliding_window(window)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; supported: {list(HIDDEN_ACTS)}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
        if self.rope_type == "default" and self.rope_scaling_factor != 1.0:
            raise ValueError(f"rope_scaling_factor={self.rope_scaling_factor} needs a rope_type other than 'default'")
        keys = dict(self.rope_parameters)
        required, optional = ROPE_PARAMETERS[self.rope_type]
        missing = [k for k in required if k not in keys]
        unknown = sorted(set(keys) - set(required) - set(optional))
        if missing or unknown:
            raise ValueError(
                f"rope_type={self.rope_type!r} takes the parameters {list(required)} (and optionally "
                f"{list(optional)}); {missing=}, {unknown=}"
            )

    def rope_parameter(self, name: str, default: float | None = None) -> float | None:
        """One of ``rope_parameters`` (``default`` when absent)."""
        return dict(self.rope_parameters).get(name, default)


HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
"""MLP gate activations (transformers' ``ACT2FN`` names): SwiGLU, Gemma's GeGLU (tanh GELU)."""

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE types ``rope_frequencies`` computes (transformers' ``ROPE_INIT_FUNCTIONS`` names)."""

ROPE_PARAMETERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": ((), ()),
    "llama3": (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("original_max_position_embeddings",),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}
"""Each RoPE type's (required, optional) ``rope_parameters`` besides theta and ``factor``."""


LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
LAYER_VECTORS = ("attn_norm", "ffn_norm")
NORM_ORDER = {False: ("attn_norm", "ffn_norm"), True: ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm")}
"""``layer_norms``' rows without and with ``sandwich_norms``."""


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Each checkpoint tensor's shape as checkpoints store it (matrices [out, in], PyTorch's
    Linear layout, which GGUF and safetensors files share), keyed by its checkpoint name
    (``assemble_params``'s ``get``): the globals ``embed``, ``final_norm``, ``lm_head`` and
    the per-layer names; biases ``bq``/``bk``/``bv``/``bo`` only when the config has them."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "embed": (c.vocab_size, h),
        "final_norm": (h,),
        "lm_head": (c.vocab_size, h),
        "attn_norm": (h,),
        "ffn_norm": (h,),
        "wq": (q, h),
        "wk": (kv, h),
        "wv": (kv, h),
        "wo": (h, q),
        "w_gate": (i, h),
        "w_up": (i, h),
        "w_down": (h, i),
    }
    if c.qkv_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if c.o_bias:
        shapes["bo"] = (h,)
    if c.qk_norm:
        shapes.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
    if c.sandwich_norms:
        shapes.update(post_attn_norm=(h,), post_ffn_norm=(h,))
    return shapes


def layer_param_names(config: LlamaConfig) -> tuple[str, ...]:
    """A layer's checkpoint tensors (``param_shapes``'s per-layer names) for this config."""
    biases = ("bq", "bk", "bv") * config.qkv_bias + ("bo",) * config.o_bias
    norms = ("q_norm", "k_norm") * config.qk_norm + ("post_attn_norm", "post_ffn_norm") * config.sandwich_norms
    return LAYER_VECTORS + LAYER_MATRICES + biases + norms


def fuse_params(config: LlamaConfig, params: dict) -> dict:
    """``params`` in the model's layout from weights named as in a checkpoint.

    Args:
      config: the model's hyperparameters.
      params: ``embed`` [V, H], ``final_norm`` [H], ``lm_head`` [H, V] (absent when tied)
        and ``layers``, per-layer dicts of ``layer_param_names``' tensors with every matrix
        [in, out] (``x @ w``); NumPy or jax arrays (the result is of the same kind).

    Returns the same globals, ``layer_norms`` [L, 2, H] (every layer's ``attn_norm`` and
    ``ffn_norm``), ``qk_norms`` [L, 2, D] with ``qk_norm`` (``q_norm``, ``k_norm``) and
    ``layers``: per layer ``wqkv`` [Hkv, G + 2, D, H] (each KV head's G = Hq / Hkv query
    heads, then its key and value: one matmul, split over the model axis by KV head), ``wo``
    [H, Hq*D], ``w_gate_up`` [2, I, H] (the gate's and the up projection's rows: one matmul,
    split over the model axis by I), ``w_down`` [H, I], and ``bqkv`` [Hkv, G + 2, D] / ``bo``
    [H] when the config has biases. Every matrix is [out, in] (PyTorch's Linear layout, as
    checkpoints store it), so each ends in the dimension its matmul sums over. Fewer, larger
    arrays: fewer matmuls, and fewer arguments for a jitted step to pass (each costs its call
    host time); the serving engine passes the matrices that end in H as one buffer a layer
    (``serving/layer_buffers.py``).
    """
    c = config
    xp = jnp if isinstance(params["embed"], jax.Array) else np

    def qkv(q, k, v, rows: tuple[int, ...]):  # [Hq*D, *rows], [Hkv*D, *rows] x 2 -> [Hkv, G + 2, D, *rows]
        shape = (c.num_kv_heads, -1, c.head_dim, *rows)
        return xp.concatenate([q.reshape(shape), k.reshape(shape), v.reshape(shape)], axis=1)

    def out_in(w):  # [in, out] -> [out, in], NumPy's contiguous
        return w.T if xp is jnp else np.ascontiguousarray(w.T)

    layers = []
    for w in params["layers"]:
        h = w["wq"].shape[0]
        layer = {
            "wqkv": qkv(w["wq"].T, w["wk"].T, w["wv"].T, (h,)),
            "wo": out_in(w["wo"]),
            "w_gate_up": xp.stack([w["w_gate"].T, w["w_up"].T]),
            "w_down": out_in(w["w_down"]),
        }
        if c.qkv_bias:
            layer["bqkv"] = qkv(w["bq"], w["bk"], w["bv"], ())
        if c.o_bias:
            layer["bo"] = w["bo"]
        layers.append(layer)
    fused = {k: v for k, v in params.items() if k != "layers"}
    norm_names = NORM_ORDER[c.sandwich_norms]
    fused["layer_norms"] = xp.stack([xp.stack([w[n] for n in norm_names]) for w in params["layers"]])
    if c.qk_norm:  # [L, 2, D], replicated like layer_norms (every head shares its layer's weights)
        fused["qk_norms"] = xp.stack([xp.stack([w["q_norm"], w["k_norm"]]) for w in params["layers"]])
    fused["layers"] = layers
    return fused


def assemble_params(config: LlamaConfig, get: Callable[[str, int | None, tuple[int, ...]], np.ndarray], dtype) -> dict:
    """The one conversion from a checkpoint's tensors to ``params`` (every loader uses it).

    Args:
      config: the model's hyperparameters.
      get: ``get(name, layer, shape)`` returns the checkpoint's tensor ``name`` (a key of
        ``param_shapes``) of ``layer`` (None for ``embed``/``final_norm``/``lm_head``) with
        ``shape`` (matrices [out, in]); it raises its loader's error for a missing tensor
        or another shape.
      dtype: NumPy dtype of the returned weights.

    Returns ``fuse_params``' layout (NumPy, C-contiguous), every matrix as [out, in].
    """
    shapes = param_shapes(config)

    def convert(name: str, layer: int | None) -> np.ndarray:
        w = np.asarray(get(name, layer, shapes[name]))
        return np.ascontiguousarray(w if w.ndim == 1 else w.T, dtype=dtype)

    params: dict = {"embed": np.ascontiguousarray(get("embed", None, shapes["embed"]), dtype=dtype)}
    params["layers"] = [
        {name: convert(name, i) for name in layer_param_names(config)} for i in range(config.num_layers)
    ]
    params["final_norm"] = convert("final_norm", None)
    if not config.tie_word_embeddings:
        params["lm_head"] = convert("lm_head", None)
    return fuse_params(config, params)


def init_params(config: LlamaConfig, seed: int = 0, dtype=np.float32) -> dict:
    """Random weights in ``fuse_params``' layout (tests and benchmarks of other shapes)."""
    rng = np.random.default_rng(seed)
    c = config
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_layers
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * shape[-2] ** -0.5).astype(dtype)

    params = {
        "embed": w(c.vocab_size, h),
        "final_norm": (1 + 0.1 * rng.standard_normal(h)).astype(dtype),
        "layers": [
            {
                "attn_norm": (1 + 0.1 * rng.standard_normal(h)).astype(dtype),
                "ffn_norm": (1 + 0.1 * rng.standard_normal(h)).astype(dtype),
                "wq": w(h, q),
                "wk": w(h, kv),
                "wv": w(h, kv),
                "wo": w(q, h),
                "w_gate": w(h, i),
                "w_up": w(h, i),
                "w_down": w(i, h),
            }
            for _ in range(layers)
        ],
    }
    for layer in params["layers"]:
        if c.sandwich_norms:
            layer.update(post_attn_norm=(1 + 0.1 * rng.standard_normal(h)).astype(dtype))
            layer.update(post_ffn_norm=(1 + 0.1 * rng.standard_normal(h)).astype(dtype))
        if c.qk_norm:
            layer.update(q_norm=(1 + 0.1 * rng.standard_normal(c.head_dim)).astype(dtype))
            layer.update(k_norm=(1 + 0.1 * rng.standard_normal(c.head_dim)).astype(dtype))
        if c.qkv_bias:
            layer.update(bq=w(1, q)[0], bk=w(1, kv)[0], bv=w(1, kv)[0])
        if c.o_bias:
            layer["bo"] = w(1, h)[0]
    if not c.tie_word_embeddings:
        params["lm_head"] = w(h, c.vocab_size)
    return fuse_params(config, params)


def rms_norm(x, weight, eps: float, offset: float = 0.0):
    """Hugging Face's LlamaRMSNorm: ``weight * x / sqrt(mean(x^2) + eps)`` in float32; with
    an ``offset`` Gemma's: ``x / sqrt(mean(x^2) + eps) * (offset + weight)`` all in float32."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    if offset:
        return (x32 * jax.lax.rsqrt(variance + eps) * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype)


def soft_cap(x, cap: float | None):
    """``cap * tanh(x / cap)`` (Gemma's logit soft cap); x itself when ``cap`` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def rope_frequencies(config: LlamaConfig, dim: int | None = None) -> tuple[np.ndarray, float]:
    """``(inv_freq f32[D/2], attention_scaling)`` of the config's RoPE, computed in float32
    as transformers' ``ROPE_INIT_FUNCTIONS[rope_type]`` does: cos and sin are multiplied by
    ``attention_scaling`` (1 except for YaRN). ``dim``: the rotated width (default
    ``config.head_dim``; DeepSeek's ``qk_rope_head_dim``, its config read alike).

    Example::

        inv_freq, scale = rope_frequencies(LlamaConfig(..., rope_type="llama3", rope_scaling_factor=8.0,
            rope_parameters=(("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                             ("original_max_position_embeddings", 8192))))
    """
    c = config
    dim, factor, get = c.head_dim if dim is None else dim, c.rope_scaling_factor, c.rope_parameter
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.float32(c.rope_theta) ** exponents  # f32[D/2]
    inv_freq = np.float32(1.0) / pos_freqs
    if c.rope_type == "default":
        return inv_freq, 1.0
    if c.rope_type == "linear":
        return inv_freq / np.float32(factor), 1.0
    if c.rope_type == "llama3":
        low, high = get("low_freq_factor"), get("high_freq_factor")
        old_context = get("original_max_position_embeddings")
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
        smooth = (np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    # yarn
    original = get("original_max_position_embeddings")
    attention_factor = get("attention_factor")
    mscale, mscale_all_dim = get("mscale"), get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = get("beta_fast") or 32, get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(c.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = np.float32(1) - ramp.astype(np.float32)
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = interpolation * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(positions, inv_freq, attention_scaling: float = 1.0):
    """cos, sin f32[T, D] for i32[T] positions and ``rope_frequencies``' f32[D/2] inverse
    frequencies (Hugging Face's rotate-half layout), each times ``attention_scaling``."""
    inv_freq = jnp.asarray(inv_freq, jnp.float32)  # f32[D/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # f32[T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if attention_scaling == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * attention_scaling, jnp.sin(emb) * attention_scaling


def apply_rope(x, cos, sin):
    """x f[T, H, D] rotated: ``x * cos + rotate_half(x) * sin``, with ``rotate_half`` the
    halves reversed and the first negated. A reverse, not a concatenate: on a GPU XLA then
    makes a loop fusion of k's rotation, which it fuses with the value slice beside it
    (BENCHMARKS.md, stop 62)."""
    half = x.shape[-1] // 2
    halves = x.reshape(*x.shape[:-1], 2, half)
    rotated = (halves[..., ::-1, :] * jnp.asarray([-1, 1], x.dtype)[:, None]).reshape(x.shape)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


class LlamaModel:
    """The decoder: static structure only; weights, caches and batches are arguments
    (a ``attn_jax.models.base.ServingModel``).

    Args:
      config: the model's hyperparameters.
      block_size: tokens per KV cache page.
      kv_cache_dtype: vLLM's cache dtype names ("auto" = the activation dtype).
      attn_backend: a backend class; None lets the selector choose.
      dtype: activation dtype (float32 default).
      num_heads / num_kv_heads / intermediate_size: the local (per-device) sizes when the
        model runs sharded inside ``shard_map`` (``attn_jax.sharding``); default: config's.
      model_axis: the mesh axis to ``psum`` partial attention / MLP outputs over, with
        ``attn_sharded`` / ``mlp_sharded`` saying which are split over it; ``head_sharded``:
        the (untied) LM head's vocabulary columns are split over it too, each shard's logits
        gathered (vLLM's parallel LM head: the head is read once over the axis, not on each).
    """

    row_matrices = ("wqkv", "w_gate_up", "wo", "w_down")
    """``fuse_params``' matrices, each stored [out, in]: the serving engine packs a layer's that
    end in H into one buffer (``serving/layer_buffers.py``)."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        attn_backend=None,
        dtype=jnp.float32,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        model_axis: str | None = None,
        attn_sharded: bool = False,
        mlp_sharded: bool = False,
        head_sharded: bool = False,
    ) -> None:
        self.config = config
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self.model_axis = model_axis
        self.attn_sharded = attn_sharded
        self.mlp_sharded = mlp_sharded
        self.head_sharded = head_sharded
        self.num_heads = num_heads or config.num_heads
        self.num_kv_heads = num_kv_heads or config.num_kv_heads
        self.inv_freq, self.rope_attention_scaling = rope_frequencies(config)
        self.local_inv_freq = None
        if config.local_rope_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.local_rope_theta, rope_type="default", rope_scaling_factor=1.0,
                rope_parameters=(),
            )  # fmt: skip
            self.local_inv_freq, _ = rope_frequencies(local)
        self.layer_windows = config.layer_sliding_windows or (config.sliding_window,) * config.num_layers
        attns = {}  # one layer object per distinct window: same backend, cache shape and metadata
        for window in dict.fromkeys(self.layer_windows):
            attns[window] = Attention(
                self.num_heads,
                config.head_dim,
                config.head_dim**-0.5 if config.attn_scale is None else config.attn_scale,
                self.num_kv_heads,
                block_size=block_size,
                kv_cache_dtype=kv_cache_dtype,
                attn_backend=attn_backend,
                dtype=self.dtype,
                logits_soft_cap=config.attn_logit_softcap,
                per_layer_sliding_window=window,
                prefix="model.layers.*.self_attn.attn",
            )
        self.layer_attns = [attns[window] for window in self.layer_windows]
        # The group's builder: a sliding layer's when there is one (its spec turns cascade attention off,
        # which a windowed layer cannot use); the metadata is otherwise the same for every window.
        self.attn = next((a for w, a in attns.items() if w is not None), self.layer_attns[0])

    @property
    def attn_backend(self):
        return self.attn.attn_backend

    @property
    def attention_group(self) -> AttentionGroup:
        """Every layer's attention: one backend, one metadata per step (``ServingModel``)."""
        names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(self.config.num_layers))
        return AttentionGroup(self.attn.attn_backend, self.attn.metadata_builder, self.block_size, names)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache shape (the backend's; [2, P, S, Hkv, D] for XLA)."""
        return self.attn.attn_backend.get_kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, self.config.head_dim, self.attn.kv_cache_dtype
        )

    def init_kv_caches(self, num_blocks: int) -> list[jax.Array]:
        """Zero caches, one per layer (a list of ``num_layers`` arrays)."""
        return [self.attn.init_kv_cache(num_blocks) for _ in range(self.config.num_layers)]

    def step(self, params, kv_caches, token_ids, positions, attn_metadata, logits_rows):
        """One forward pass over a packed batch; returns (logits, kv_caches).

        Args:
          params: weights in ``fuse_params``' layout (``load_gguf``'s; NumPy or jax arrays).
          kv_caches: list of per-layer caches; donate them under ``jit``.
          token_ids: i32[T], padding rows anything in range.
          positions: i32[T], each token's absolute position in its request.
          attn_metadata: ``CommonAttentionMetadata`` or the backend's metadata
            (``build_for_jit``) describing the T rows.
          logits_rows: i32[N], the rows whose next-token logits are wanted (usually each
            request's last new token).

        Returns logits f32[N, vocab_size] and the updated caches.
        """
        c = self.config
        x = jnp.asarray(params["embed"])[token_ids].astype(self.dtype)  # f[T, H]
        if c.embed_scale != 1.0:
            x = x * jnp.asarray(c.embed_scale, self.dtype)
        rope = rope_cos_sin(positions, self.inv_freq, self.rope_attention_scaling)
        local_rope = rope if self.local_inv_freq is None else rope_cos_sin(positions, self.local_inv_freq)
        num_tokens = token_ids.shape[0]
        if isinstance(attn_metadata, CommonAttentionMetadata):
            attn_metadata = self.attn.metadata_builder.build(0, attn_metadata)  # once, not per layer

        group = self.num_heads // self.num_kv_heads

        def norm(x, weight):
            return rms_norm(x, weight, c.rms_norm_eps, c.norm_offset)

        act = jax.nn.silu if c.hidden_act == "silu" else functools.partial(jax.nn.gelu, approximate=True)

        def layer(h, w, norms, qk_norms, attn, cos_sin, cache, attn_metadata):
            x = norm(h, norms[0])
            qkv = jnp.einsum("th,kgdh->tkgd", x, w["wqkv"], precision=_HIGHEST)  # f[T, Hkv, G + 2, D]
            if c.qkv_bias:
                qkv = qkv + w["bqkv"]
            q = qkv[:, :, :group].reshape(num_tokens, self.num_heads, c.head_dim)
            k, v = qkv[:, :, group], qkv[:, :, group + 1]
            if c.qk_norm:
                q, k = norm(q, qk_norms[0]), norm(k, qk_norms[1])
            q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
            o, cache = attn(q, k, v, cache, attn_metadata)
            o = jnp.einsum("tq,hq->th", o, w["wo"], precision=_HIGHEST)
            if self.attn_sharded:
                o = jax.lax.psum(o, self.model_axis)
            if c.o_bias:  # after the sum over heads: once, not once per shard
                o = o + w["bo"]
            if c.sandwich_norms:
                o = norm(o, norms[1])
            h = h + o
            x = norm(h, norms[2 if c.sandwich_norms else 1])
            gate_up = jnp.einsum("th,gih->tgi", x, w["w_gate_up"], precision=_HIGHEST)  # f[T, 2, I]
            mlp = jnp.einsum("ti,hi->th", act(gate_up[:, 0]) * gate_up[:, 1], w["w_down"], precision=_HIGHEST)
            if self.mlp_sharded:
                mlp = jax.lax.psum(mlp, self.model_axis)
            if c.sandwich_norms:
                mlp = norm(mlp, norms[3])
            return h + mlp, cache

        # Traced and lowered once for all the layers of a window (``attn``, static: one object per
        # window), not once per layer; XLA inlines the calls, so the program is the same (SmolLM2 on
        # a CPU: an engine's first two step programs 12.5 -> 8 s, from the compilation cache 5.2 -> 3.1 s).
        layer = jax.jit(layer, static_argnums=4)
        h, new_caches = x, []
        layer_norms = jnp.asarray(params["layer_norms"])
        qk_norms = jnp.asarray(params["qk_norms"]) if c.qk_norm else [None] * c.num_layers
        for i, (w, cache) in enumerate(zip(params["layers"], kv_caches, strict=True)):
            window = self.layer_windows[i]
            cos_sin = rope if window is None else local_rope
            h, cache = layer(h, w, layer_norms[i], qk_norms[i], self.layer_attns[i], cos_sin, cache, attn_metadata)
            new_caches.append(cache)
        h = norm(h[logits_rows], params["final_norm"])  # f[N, H]
        head = params.get("lm_head")
        if head is None:
            logits = jnp.dot(h, jnp.asarray(params["embed"]).T, precision=_HIGHEST)
        else:
            logits = jnp.dot(h, head, precision=_HIGHEST)
            if self.head_sharded:  # this shard's vocabulary columns: gathered, in the activation dtype
                logits = jax.lax.all_gather(logits, self.model_axis, axis=1, tiled=True)
        return soft_cap(logits.astype(jnp.float32), c.final_logit_softcap), new_caches
