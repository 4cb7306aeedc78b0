"""Llama-family and DeepSeek models from a Hugging Face checkpoint folder: no torch, no transformers.

A folder written by transformers' ``save_pretrained`` (or downloaded from the Hub) holds
``config.json``, the weights as one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, and the tokenizer as ``tokenizer.json`` with
``tokenizer_config.json`` (special tokens) and the chat template (``chat_template.jinja``
or the ``chat_template`` entry of ``tokenizer_config.json``). The weights are read with
``safetensors``' NumPy API (bfloat16 through ``ml_dtypes``), converted by the same
``llama.assemble_params`` as the GGUF path; the tokenizer runs on ``tokenizers``.

Model types: ``SUPPORTED_MODEL_TYPES`` (Llama; Mistral with its sliding window; Qwen2 with
its q/k/v biases; Qwen3 with its per-head q/k RMSNorm; Gemma 2 / 3 text; DeepSeek-V2 / V3,
read by ``deepseek_config`` into ``deepseek.DeepSeekModel``: MLA, the routed and shared
experts, V2's softmax routers and V3's grouped sigmoid one). RoPE types: ``SUPPORTED_ROPE_TYPES``
(default, linear, Llama 3.1's llama3, YaRN), read from ``rope_scaling`` or ``rope_parameters``
with transformers 5's precedence (``_rope``). Weight dtypes: F32, F16, BF16. A configuration
key that would change the model and that the loader does not read (a RoPE parameter,
``partial_rotary_factor``, ``quantization_config``, ``hidden_act``...) is refused by name.

Example::

    model, params, tokenizer = load_hf_checkpoint("path/to/checkpoint")
    engine = Engine(model, params, tokenizer)
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from attn_jax.models import deepseek
from attn_jax.models.deepseek import DeepSeekConfig, DeepSeekModel
from attn_jax.models.gguf_loader import ModelLoadError, check_finite_tensor
from attn_jax.models.gguf_tokenizer import GGUFTokenizer
from attn_jax.models.llama import HIDDEN_ACTS, ROPE_PARAMETERS, ROPE_TYPES, LlamaConfig, LlamaModel, assemble_params

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *GEMMA_MODEL_TYPES, *DEEPSEEK_MODEL_TYPES)
"""``config.json``'s ``model_type`` values this loader reads."""

SUPPORTED_ROPE_TYPES = ROPE_TYPES
"""``rope_parameters`` / ``rope_scaling`` types ``LlamaModel`` computes (``llama.rope_frequencies``)."""

WEIGHT_DTYPES = ("F32", "F16", "BF16")
"""safetensors dtypes read (any of them converts to the requested dtype)."""

MODEL_DTYPES = ("float32", "bfloat16", "float16")
"""``dtype`` values of ``load_hf_checkpoint`` (weights and activations)."""

_TENSOR_NAMES = {  # llama.param_shapes key -> checkpoint tensor name ("{i}": the layer)
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "bq": "model.layers.{i}.self_attn.q_proj.bias",
    "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
    "bo": "model.layers.{i}.self_attn.o_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
}
_SANDWICH_NORM_NAMES = {  # Gemma 2 / 3: post_attention_layernorm follows attention, before the residual
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_ffn_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved; recomputed here
_SPECIAL_TOKENS = ("bos", "eos", "unk", "pad")


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder (a checkpoint to read with this module, not a GGUF file)."""
    return pathlib.Path(path).is_dir()


def _folder(path: str | os.PathLike) -> pathlib.Path:
    folder = pathlib.Path(path)
    if not folder.exists():
        raise ModelLoadError(f"checkpoint folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ModelLoadError(
            f"{str(folder)!r} is not a folder (a Hugging Face checkpoint is a folder with config.json)"
        )
    return folder


def _read_json(path: pathlib.Path, required: bool = True) -> dict | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(
                f"{str(path.parent)!r} has no {path.name}: a Hugging Face checkpoint folder holds config.json, "
                "*.safetensors and tokenizer.json"
            )
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{str(path)!r} is not readable JSON: {e}") from e
    if not isinstance(value, dict):
        raise ModelLoadError(f"{str(path)!r} holds a {type(value).__name__}, not a JSON object")
    return value


def _positive(config: Mapping, key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json {key}={value!r} must be a positive integer")
    return value


def _token_ids(value, key: str) -> tuple[int, ...]:
    """An ``eos_token_id`` entry: an int, a list of ints, or null."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{key}={value!r} must be a token id or a list of token ids")
    return tuple(values)


def _rope(config: Mapping, max_position_embeddings: int) -> dict:
    """``LlamaConfig``'s ``rope_*`` fields, read as transformers 5 reads them: a non-empty
    ``rope_scaling`` (the older key) replaces ``rope_parameters`` whole, its ``rope_theta``
    included; theta is the chosen object's ``rope_theta``, else the top-level ``rope_theta``,
    else 10000; llama3's and YaRN's ``original_max_position_embeddings`` defaults to
    ``max_position_embeddings``. A key of the chosen object that its type does not take
    is refused by name (``partial_rotary_factor`` unless 1)."""
    scaling, parameters = config.get("rope_scaling"), config.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if value is not None and not isinstance(value, dict):
            raise ModelLoadError(f"config.json {key}={value!r} must be an object")
    source = "rope_scaling" if scaling else "rope_parameters"
    rope = dict(scaling or parameters or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_PARAMETERS:
        raise ModelLoadError(
            f"config.json {source} type {rope_type!r} is not supported by attn_jax; supported: "
            f"{list(SUPPORTED_ROPE_TYPES)}"
        )
    required, optional = ROPE_PARAMETERS[rope_type]
    known = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor", *required, *optional}
    unknown = sorted(set(rope) - known)
    if unknown:
        raise ModelLoadError(
            f"config.json {source} has keys {unknown} that attn_jax does not read for rope_type {rope_type!r} "
            f"(it reads {sorted(known - {'type'})})"
        )
    for where, value in ((source, rope.get("partial_rotary_factor")), ("", config.get("partial_rotary_factor"))):
        if value not in (None, 1, 1.0):
            name = f"{where} partial_rotary_factor" if where else "partial_rotary_factor"
            raise ModelLoadError(
                f"config.json {name}={value!r} is not supported: attn_jax rotates the whole head (DeepSeek: its "
                "qk_rope_head_dim)"
            )
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type in ("llama3", "yarn"):
        rope.setdefault("original_max_position_embeddings", max_position_embeddings)
    factor = rope.get("factor")
    if factor is None and rope_type == "yarn":  # transformers' DeepSeek-style default
        factor = max_position_embeddings / rope["original_max_position_embeddings"]
    if factor is None and rope_type != "default":
        raise ModelLoadError(f"config.json {source} of type {rope_type!r} needs a factor")
    for key, value in (("rope_theta", theta), (f"{source} factor", 1.0 if factor is None else factor)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ModelLoadError(f"config.json {key}={value!r} must be a positive number")
    extra = {}
    for key in (*required, *optional):
        value = rope.get(key)
        if value is None:
            continue
        if key == "truncate":
            if not isinstance(value, bool):
                raise ModelLoadError(f"config.json {source} truncate={value!r} must be true or false")
            extra[key] = value
        elif isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ModelLoadError(f"config.json {source} {key}={value!r} must be a positive number")
        else:
            extra[key] = float(value)
    missing = [key for key in required if key not in extra]
    if missing:
        raise ModelLoadError(f"config.json {source} of type {rope_type!r} lacks {missing}")
    if rope_type == "llama3" and not extra["low_freq_factor"] < extra["high_freq_factor"]:
        raise ModelLoadError(
            f"config.json {source} low_freq_factor={extra['low_freq_factor']} must be below "
            f"high_freq_factor={extra['high_freq_factor']}"
        )
    return dict(
        rope_theta=float(theta),
        rope_type=rope_type,
        rope_scaling_factor=1.0 if rope_type == "default" else float(factor),
        rope_parameters=tuple(sorted(extra.items())),
    )


def _sliding_windows(config: Mapping, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window (None: full attention), as transformers reads ``layer_types`` and
    each family's defaults for it."""
    if model_type == "mistral":
        window = config.get("sliding_window", 4096)  # MistralConfig's default when the key is absent
        default_types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    elif model_type in ("qwen2", "qwen3"):
        window = config.get("sliding_window", 4096) if config.get("use_sliding_window", False) else None
        first = config.get("max_window_layers", 28)
        default_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
        ]
    elif model_type in GEMMA_MODEL_TYPES:  # Gemma 2 alternates; Gemma 3 has one full layer in 6
        window = config.get("sliding_window", 4096)
        pattern = 2 if model_type == "gemma2" else config.get("sliding_window_pattern", 6)
        default_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    else:
        window, default_types = None, ["full_attention"] * num_layers
    layer_types = config.get("layer_types") or default_types
    valid = ("full_attention", "sliding_attention")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or not set(layer_types) <= set(valid):
        raise ModelLoadError(
            f"config.json layer_types={layer_types!r} must list one of {list(valid)} for each of {num_layers} layers"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"config.json sliding_window={window!r} must be a positive integer or null")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _gemma(config: Mapping, model_type: str, max_positions: int) -> dict:
    """Gemma 2 / Gemma 3 text's ``LlamaConfig`` fields, with transformers' defaults: (1 + w)
    norms, the embedding times sqrt(hidden_size), GeGLU, four norms a layer, soft caps,
    ``query_pre_attn_scalar``; Gemma 3's q/k norms and its two RoPEs (``rope_parameters``
    nested by layer type, or the older ``rope_theta`` / ``rope_scaling`` for the full layers
    and ``rope_local_base_freq`` for the sliding ones)."""
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError(
            "config.json use_bidirectional_attention=true is not supported: attn_jax's decoder is causal"
        )
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in HIDDEN_ACTS:
        raise ModelLoadError(f"config.json hidden_activation={act!r} is not supported; supported: {list(HIDDEN_ACTS)}")
    scalar = config.get("query_pre_attn_scalar", 256)
    gemma2 = model_type == "gemma2"
    caps = {}
    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        cap = config.get(key, default if gemma2 else None)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0):
            raise ModelLoadError(f"config.json {key}={cap!r} must be a positive number or null")
        caps[key] = None if cap is None else float(cap)
    if isinstance(scalar, bool) or not isinstance(scalar, int | float) or not scalar > 0:
        raise ModelLoadError(f"config.json query_pre_attn_scalar={scalar!r} must be a positive number")
    fields = dict(
        norm_offset=1.0,
        embed_scale=float(np.float32(config["hidden_size"] ** 0.5)),
        hidden_act=act,
        sandwich_norms=True,
        attn_logit_softcap=caps["attn_logit_softcapping"],
        final_logit_softcap=caps["final_logit_softcapping"],
        attn_scale=float(scalar) ** -0.5,
        qk_norm=not gemma2,
    )
    if gemma2:
        return {**fields, **_rope(config, max_positions)}
    nested = config.get("rope_parameters") or {}
    layer_kinds = ("full_attention", "sliding_attention")
    if not isinstance(nested, dict) or not set(nested) <= set(layer_kinds):
        raise ModelLoadError(
            f"config.json rope_parameters={nested!r}: a Gemma 3 config nests them by layer type, {list(layer_kinds)}"
        )
    full = dict(nested.get("full_attention") or {"rope_type": "default"})
    if config.get("rope_scaling") is not None:  # transformers merges the older key into the full layers' RoPE
        full.update(config["rope_scaling"])
    full.setdefault("rope_theta", config.get("rope_theta", 1e6))
    local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 1e4))
    if set(local) - {"rope_type", "type", "rope_theta"} or local.get("rope_type", local.get("type")) != "default":
        raise ModelLoadError(
            f"config.json rope_parameters sliding_attention={local!r} is not supported: attn_jax reads a default "
            "RoPE (rope_theta only) for Gemma 3's sliding layers"
        )
    local_theta = local["rope_theta"]
    if isinstance(local_theta, bool) or not isinstance(local_theta, int | float) or not local_theta > 0:
        raise ModelLoadError(f"config.json sliding_attention rope_theta={local_theta!r} must be a positive number")
    return {**fields, **_rope({"rope_parameters": full}, max_positions), "local_rope_theta": float(local_theta)}


_DEEPSEEK_DEFAULTS = {  # transformers' DeepseekV2Config / DeepseekV3Config values of absent keys
    "deepseek_v2": dict(
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        first_k_dense_replace=0, n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407,
        num_experts_per_tok=None, n_group=None, topk_group=None, routed_scaling_factor=1.0, norm_topk_prob=False,
        scoring_func="softmax", topk_method="greedy", rms_norm_eps=1e-6,
    ),
    "deepseek_v3": dict(
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-6,
    ),
}  # fmt: skip
DEEPSEEK_ROUTERS = {
    "deepseek_v2": ("softmax", ("greedy", "group_limited_greedy")),
    "deepseek_v3": ("sigmoid", ("noaux_tc",)),
}
"""Each DeepSeek model type's ``scoring_func`` and ``topk_method`` values, as transformers runs them."""


def deepseek_config(
    config: Mapping, name: str = "deepseek", eos_token_ids: tuple[int, ...] | None = None
) -> DeepSeekConfig:
    """The ``DeepSeekConfig`` of a DeepSeek-V2 / V3 ``config.json`` (a dict; a transformers
    config's ``to_dict()`` too), absent keys read as transformers' defaults. A key whose value
    the model does not run as transformers does is refused by name (``ModelLoadError``):
    ``scoring_func`` / ``topk_method`` other than ``DEEPSEEK_ROUTERS``' (V3's sigmoid +
    ``noaux_tc``; V2's softmax + ``greedy`` or ``group_limited_greedy``), V2's
    ``norm_topk_prob`` (transformers ignores it, DeepSeek's own code normalises),
    ``moe_layer_freq`` other than 1, ``attention_bias``, V2's ``rope_interleave=false``, and
    the RoPE keys ``_rope`` refuses. Ignored (they do not change the outputs):
    ``num_key_value_heads`` and ``head_dim`` (derived for MLA), ``num_nextn_predict_layers``
    (V3's multi-token-prediction layers: transformers does not run them either), ``ep_size``,
    ``aux_loss_alpha``, ``seq_aux``, ``pretraining_tp``."""
    model_type = config.get("model_type", "deepseek_v3")
    defaults = _DEEPSEEK_DEFAULTS[model_type]

    def get(key):
        return config.get(key, defaults.get(key))

    def number(key):
        value = get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ModelLoadError(f"config.json {key}={value!r} must be a positive number")
        return float(value)

    scoring, methods = DEEPSEEK_ROUTERS[model_type]
    for key, valid in (("scoring_func", (scoring,)), ("topk_method", methods)):
        if get(key) not in valid:
            raise ModelLoadError(
                f"config.json {key}={get(key)!r} is not supported for {model_type}; supported: {list(valid)}"
            )
    if model_type == "deepseek_v2" and get("norm_topk_prob"):
        raise ModelLoadError(
            "config.json norm_topk_prob=true is not supported for deepseek_v2: transformers' DeepseekV2 ignores it "
            "and DeepSeek's own code normalises the weights; supported: [False]"
        )
    if config.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(
            f"config.json moe_layer_freq={config['moe_layer_freq']!r} is not supported; supported: [1] (every layer "
            "from first_k_dense_replace on is a mixture of experts)"
        )
    if config.get("attention_bias"):
        raise ModelLoadError("config.json attention_bias=true is not supported for DeepSeek: supported: [False]")
    interleave = config.get("rope_interleave", True)
    if not isinstance(interleave, bool) or (model_type == "deepseek_v2" and not interleave):
        raise ModelLoadError(
            f"config.json rope_interleave={interleave!r} is not supported for {model_type}; supported: "
            f"{[True] if model_type == 'deepseek_v2' else [True, False]}"
        )
    num_layers = _positive(config, "num_hidden_layers")
    max_positions = _positive(config, "max_position_embeddings", default=2048)
    q_lora = get("q_lora_rank")
    first_dense = get("first_k_dense_replace")
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise ModelLoadError(f"config.json first_k_dense_replace={first_dense!r} must be a non-negative integer")
    moe = {}
    if first_dense < num_layers:
        grouped = get("topk_method") != "greedy"
        moe = dict(
            first_k_dense_replace=first_dense,
            n_routed_experts=_positive(config, "n_routed_experts", defaults["n_routed_experts"]),
            num_experts_per_tok=_positive(config, "num_experts_per_tok", defaults["num_experts_per_tok"]),
            n_group=_positive(config, "n_group", defaults["n_group"]) if grouped else 1,
            topk_group=_positive(config, "topk_group", defaults["topk_group"]) if grouped else 1,
            n_shared_experts=_positive(config, "n_shared_experts", defaults["n_shared_experts"]),
            moe_intermediate_size=_positive(config, "moe_intermediate_size", defaults["moe_intermediate_size"]),
            routed_scaling_factor=number("routed_scaling_factor"),
            norm_topk_prob=bool(get("norm_topk_prob")),
        )
    eos = eos_token_ids if eos_token_ids is not None else _token_ids(config.get("eos_token_id"), "eos_token_id")
    bos = config.get("bos_token_id")
    try:
        return DeepSeekConfig(
            vocab_size=_positive(config, "vocab_size"),
            hidden_size=_positive(config, "hidden_size"),
            intermediate_size=_positive(config, "intermediate_size"),
            num_layers=num_layers,
            num_heads=_positive(config, "num_attention_heads"),
            kv_lora_rank=_positive(config, "kv_lora_rank", defaults["kv_lora_rank"]),
            qk_nope_head_dim=_positive(config, "qk_nope_head_dim", defaults["qk_nope_head_dim"]),
            qk_rope_head_dim=_positive(config, "qk_rope_head_dim", defaults["qk_rope_head_dim"]),
            v_head_dim=_positive(config, "v_head_dim", defaults["v_head_dim"]),
            q_lora_rank=None if q_lora is None else _positive(config, "q_lora_rank", q_lora),
            rope_interleave=interleave,
            rms_norm_eps=number("rms_norm_eps"),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else -1,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            name=name,
            scoring_func=scoring,
            topk_method=get("topk_method"),
            **_rope(config, max_positions),
            **moe,
        )
    except ValueError as e:  # DeepSeekConfig's own checks (groups, experts per token, even RoPE width)
        raise ModelLoadError(f"config.json: {e}") from e


def stored_dtype(path: str | os.PathLike) -> str | None:
    """The dtype a checkpoint folder's weights are stored in, from config.json's ``dtype``
    (transformers 5) or ``torch_dtype``; None when it names none. ``ModelLoadError`` for a
    missing or unreadable config.json."""
    config = _read_json(_folder(path) / "config.json")
    value = config.get("dtype", config.get("torch_dtype"))
    return value if isinstance(value, str) else None


def read_hf_config(path: str | os.PathLike) -> LlamaConfig | DeepSeekConfig:
    """The ``LlamaConfig`` (``DeepSeekConfig`` for ``DEEPSEEK_MODEL_TYPES``) of a checkpoint
    folder (``config.json``, plus the EOS ids of ``generation_config.json``). Raises
    ``ModelLoadError`` naming the key for a missing file, an unsupported ``model_type`` /
    RoPE type / activation, or a bad value."""
    folder = _folder(path)
    config = _read_json(folder / "config.json")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"config.json model_type={model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    gemma = model_type in GEMMA_MODEL_TYPES
    act = config.get("hidden_act", "silu")
    if act != "silu" and not gemma:  # transformers' Gemma reads hidden_activation instead
        raise ModelLoadError(f"config.json hidden_act={act!r} is not supported; supported: ['silu']")
    if config.get("mlp_bias"):
        raise ModelLoadError("config.json mlp_bias=true is not supported: attn_jax's models have no MLP biases")
    if config.get("quantization_config") is not None:
        method = config["quantization_config"]
        method = method.get("quant_method") if isinstance(method, dict) else method
        raise ModelLoadError(
            f"config.json quantization_config (quant_method={method!r}) is not supported: attn_jax reads "
            "F32, F16 and BF16 weights only"
        )
    generation = _read_json(folder / "generation_config.json", required=False) or {}
    eos = _token_ids(config.get("eos_token_id"), "config.json eos_token_id")
    eos += tuple(t for t in _token_ids(generation.get("eos_token_id"), "generation_config.json eos_token_id"))
    if model_type in DEEPSEEK_MODEL_TYPES:
        return deepseek_config(config, name=folder.resolve().name, eos_token_ids=eos)
    num_heads = _positive(config, "num_attention_heads")
    hidden = _positive(config, "hidden_size")
    num_layers = _positive(config, "num_hidden_layers")
    max_positions = _positive(config, "max_position_embeddings", default=2048)
    family = _gemma(config, model_type, max_positions) if gemma else _rope(config, max_positions)
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif model_type in ("llama", "qwen3", *GEMMA_MODEL_TYPES):
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    else:
        qkv_bias = o_bias = False
    bos = config.get("bos_token_id")
    eps = config.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ModelLoadError(f"config.json rms_norm_eps={eps!r} must be a positive number")
    windows = _sliding_windows(config, model_type, num_layers)
    uniform = len(set(windows)) == 1
    default_head_dim = 256 if gemma else 128 if model_type == "qwen3" else hidden // num_heads
    try:
        return LlamaConfig(
            vocab_size=_positive(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive(config, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=_positive(config, "num_key_value_heads", default=num_heads),
            head_dim=_positive(config, "head_dim", default=default_head_dim),
            rms_norm_eps=float(eps),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else -1,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            name=folder.resolve().name,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=windows[0] if uniform else None,
            layer_sliding_windows=() if uniform else windows,
            **({"qk_norm": model_type == "qwen3"} | family),
        )
    except ValueError as e:  # LlamaConfig's own checks (head divisibility, even head_dim)
        raise ModelLoadError(f"config.json of {str(folder)!r}: {e}") from e


def _weight_files(folder: pathlib.Path) -> list[pathlib.Path]:
    index = _read_json(folder / "model.safetensors.index.json", required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{str(folder / 'model.safetensors.index.json')!r} has no weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{str(folder)!r} lacks the shards {missing} that model.safetensors.index.json lists")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        raise ModelLoadError(
            f"{str(folder)!r} has no *.safetensors weights"
            + (f" (it has {others}: only safetensors checkpoints are read, without torch)" if others else "")
        )
    return files


class _Tensors(contextlib.ExitStack):
    """A folder's safetensors files open (a context manager): ``get(name, shape)`` reads one
    tensor, checking it exists with that shape, a read dtype and (``check_finite``) finite
    values; ``refuse_unused`` names the tensors nothing read. Every family's loader reads
    through it."""

    def __init__(self, folder: pathlib.Path, progress: Callable[[int, int], None] | None, check_finite: bool):
        super().__init__()
        self.folder, self.progress, self.check_finite = folder, progress, check_finite
        self.where, self.used = {}, set()

    def __enter__(self) -> _Tensors:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors' BF16)
        from safetensors import safe_open

        super().__enter__()
        for file in _weight_files(self.folder):
            try:
                handle = self.enter_context(safe_open(str(file), framework="np"))
            except Exception as e:  # safetensors raises its own SafetensorError for a damaged header
                self.close()
                raise ModelLoadError(f"{str(file)!r} is not a readable safetensors file: {e}") from e
            self.where.update(dict.fromkeys(handle.keys(), handle))
        return self

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        handle = self.where.get(name)
        if handle is None:
            raise ModelLoadError(
                f"{str(self.folder)!r} has no tensor {name!r}, which the model of its config.json needs"
            )
        view = handle.get_slice(name)
        if view.get_dtype() not in WEIGHT_DTYPES:
            raise ModelLoadError(
                f"tensor {name!r} has dtype {view.get_dtype()}; supported: {list(WEIGHT_DTYPES)} (quantised "
                "safetensors checkpoints are not read)"
            )
        if tuple(view.get_shape()) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(view.get_shape())}; config.json implies {shape}")
        self.used.add(name)
        tensor = handle.get_tensor(name)
        if self.check_finite:
            check_finite_tensor(name, tensor, str(self.folder))
        if self.progress is not None:
            self.progress(len(self.used), len(self.where))
        return tensor

    def refuse_unused(self, ignored: Callable[[str], bool]) -> None:
        """``ModelLoadError`` naming tensors neither read nor ``ignored`` (and not ``_IGNORED_SUFFIXES``)."""
        unused = sorted(n for n in self.where if n not in self.used and not n.endswith(_IGNORED_SUFFIXES))
        unused = [n for n in unused if not ignored(n)]
        if unused:
            raise ModelLoadError(
                f"{str(self.folder)!r} has {len(unused)} tensors the model would not use, e.g. {unused[:4]}: "
                "config.json does not describe these weights"
            )


def load_hf_weights(
    path: str | os.PathLike,
    dtype=np.float32,
    progress: Callable[[int, int], None] | None = None,
    check_finite: bool = True,
) -> tuple[LlamaConfig | DeepSeekConfig, dict]:
    """Reads a checkpoint folder's config and safetensors weights (``load_gguf``'s sibling).

    Args:
      path: the checkpoint folder.
      dtype: NumPy dtype of the returned weights (float32 default; ``ml_dtypes.bfloat16`` works).
      progress: called as ``progress(done, total)`` after each tensor.
      check_finite: raise ``ModelLoadError`` naming the first tensor (in load order) with a
        NaN or an infinity (one more pass over each tensor; False skips it).

    Returns ``(config, params)`` in ``load_gguf``'s layout (``llama.assemble_params``), with
    ``bqkv`` [Hkv, G + 2, D] per layer when the config has q/k/v biases and ``bo`` [H] when it
    has an output bias; for a DeepSeek config ``deepseek.assemble_params``'
    layout (tensors of V3's multi-token-prediction layers, past ``num_hidden_layers``, are
    not read). Raises ``ModelLoadError`` for a missing file or tensor, a tensor of another
    shape or dtype, or a tensor the model would not use.
    """
    folder = _folder(path)
    config = read_hf_config(folder)
    with _Tensors(folder, progress, check_finite) as tensors:
        if isinstance(config, DeepSeekConfig):
            params = deepseek.assemble_params(config, tensors.get, dtype)
            extra = _read_json(folder / "config.json").get("num_nextn_predict_layers") or 0
            mtp = tuple(f"model.layers.{config.num_layers + i}." for i in range(extra if isinstance(extra, int) else 0))
            tensors.refuse_unused(lambda name: name.startswith(mtp))
        else:
            names = {**_TENSOR_NAMES, **(_SANDWICH_NORM_NAMES if config.sandwich_norms else {})}
            params = assemble_params(config, lambda key, i, shape: tensors.get(names[key].format(i=i), shape), dtype)
            tied = _TENSOR_NAMES["lm_head"] if config.tie_word_embeddings else None  # transformers uses the embedding
            tensors.refuse_unused(lambda name: name == tied)
    return config, params


class HFTokenizer(GGUFTokenizer):
    """A checkpoint's tokenizer (``tokenizer.json``) with its special tokens and chat template.

    The interface is ``GGUFTokenizer``'s (``encode``, ``__call__``, ``decode``,
    ``apply_chat_template``, ``eos_token_id``...). As transformers 5's generic
    ``TokenizersBackend`` does, ``tokenizer.json``'s own post-processor (Llama 3's BOS, say)
    decides which special tokens ``encode`` adds; only a ``tokenizer.json`` without one gets
    BOS / EOS from ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token``
    (default: none). Model-specific transformers classes that rebuild the pipeline from the
    vocabulary (its ``LlamaTokenizer`` for SentencePiece vocabularies) may differ.
    """

    def __init__(
        self,
        tokenizer,
        special_ids: Mapping[str, int | None],
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ) -> None:
        original = tokenizer.post_processor
        super().__init__(tokenizer, special_ids, chat_template, add_bos_token, add_eos_token)
        if original is not None:
            tokenizer.post_processor = original
            ids = tokenizer.encode("", add_special_tokens=True).ids  # what the post-processor adds
            self.add_bos_token = bool(ids) and ids[0] == self.bos_token_id
            self.add_eos_token = bool(ids) and ids[-1] == self.eos_token_id

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
        """Reads ``tokenizer.json``, ``tokenizer_config.json`` (or ``special_tokens_map.json``)
        and the chat template from a checkpoint folder. Raises ``ModelLoadError``."""
        from tokenizers import Tokenizer

        folder = _folder(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(
                f"{str(folder)!r} has no tokenizer.json (a SentencePiece tokenizer.model alone is not read: save the "
                "tokenizer with transformers' save_pretrained to write tokenizer.json)"
            )
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own Exception type for a bad file
            raise ModelLoadError(f"{str(file)!r} is not a readable tokenizer: {e}") from e
        settings = _read_json(folder / "tokenizer_config.json", required=False) or {}
        specials = _read_json(folder / "special_tokens_map.json", required=False) or {}
        special_ids = {}
        for name in _SPECIAL_TOKENS:
            token = settings.get(f"{name}_token", specials.get(f"{name}_token"))
            if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
                token = token.get("content")
            token_id = None if token is None else tokenizer.token_to_id(token)
            if token is not None and token_id is None:
                raise ModelLoadError(
                    f"tokenizer_config.json {name}_token={token!r} is not in tokenizer.json's vocabulary"
                )
            special_ids[name] = token_id
        template, source = _chat_template(folder, settings)
        if template is not None:
            _compile_chat_template(template, source)
        tok = cls(
            tokenizer,
            special_ids,
            chat_template=template,
            add_bos_token=bool(settings.get("add_bos_token", False)),
            add_eos_token=bool(settings.get("add_eos_token", False)),
        )
        tok.chat_template_source = source
        return tok

    chat_template_source: str | None = None
    """Where the chat template came from (``"tokenizer_config.json chat_template"``...), for messages."""

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs,
    ) -> list[int] | str:
        """``GGUFTokenizer.apply_chat_template`` with the checkpoint's template."""
        if self.chat_template is None:
            raise ValueError(
                "this checkpoint has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template): encode the prompt as plain text instead"
            )
        import jinja2

        try:
            return super().apply_chat_template(messages, add_generation_prompt, tokenize, **template_kwargs)
        except jinja2.TemplateError as e:  # the template's raise_exception, or an undefined name
            raise ValueError(f"the chat template ({self.chat_template_source}) failed on these messages: {e}") from e

    def __repr__(self) -> str:
        return "HF" + super().__repr__().removeprefix("GGUF")


def _chat_template(folder: pathlib.Path, settings: Mapping) -> tuple[str | None, str | None]:
    """(template, where it came from) in transformers' order: ``chat_template.jinja``,
    ``chat_template.json``, then ``tokenizer_config.json``'s ``chat_template`` (a string, or
    named templates: "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8"), repr(str(jinja))
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{str(jinja)!r} is not readable UTF-8 text: {e}") from e
    source = f"{str(folder / 'chat_template.json')!r} chat_template"
    template = (_read_json(folder / "chat_template.json", required=False) or {}).get("chat_template")
    if template is None:
        source = f"{str(folder / 'tokenizer_config.json')!r} chat_template"
        template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ModelLoadError(f"{source} names chat templates {list(named)}; none is 'default'")
        template, source = named["default"], f"{source} 'default'"
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{source} is a {type(template).__name__}, not a string")
    return template, None if template is None else source


def _compile_chat_template(template: str, source: str) -> None:
    """Compiles the template as rendering will (``gguf_tokenizer._compiled_template``, cached):
    a syntax error, an unknown filter or test is a ``ModelLoadError`` naming ``source``
    (file and key) and the template's line, found at load rather than at the first chat."""
    import jinja2

    from attn_jax.models.gguf_tokenizer import _compiled_template

    try:
        _compiled_template(template)
    except jinja2.TemplateSyntaxError as e:  # TemplateAssertionError (unknown filter) included
        raise ModelLoadError(f"the chat template in {source} does not compile: {e.message} (line {e.lineno})") from e


def load_hf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The checkpoint folder's tokenizer (``HFTokenizer.from_pretrained``)."""
    return HFTokenizer.from_pretrained(path)


def load_hf_checkpoint(
    path: str | os.PathLike,
    dtype="float32",
    *,
    block_size: int = 16,
    attn_backend=None,
    kv_cache_dtype: str = "auto",
    mesh=None,
    progress: Callable[[str, int, int], None] | None = None,
    check_finite: bool = True,
) -> tuple[LlamaModel | DeepSeekModel, dict, HFTokenizer]:
    """``(model, params, tokenizer)`` of a checkpoint folder: what ``Engine(model, params,
    tokenizer, mesh=mesh, ...)`` takes; a ``DeepSeekModel`` (its MLA attention on the MLA
    backends: ``get_attn_backend(..., use_mla=True)``) for ``DEEPSEEK_MODEL_TYPES``.

    Args:
      path: the checkpoint folder.
      dtype: weights and activations, one of ``MODEL_DTYPES`` (float32 default, whatever
        the checkpoint stores).
      block_size / attn_backend / kv_cache_dtype: ``LlamaModel``'s (``DeepSeekModel``'s).
      mesh: the engine's mesh (``attn_jax.sharding.make_mesh``); the model is built for
        one shard of it. DeepSeek models run on one device (a mesh of more is refused).
      progress: ``progress(stage, done, total)`` while the weights ("weights") and the
        tokenizer ("tokenizer") load, as ``Engine.from_gguf`` calls it.
      check_finite: ``load_hf_weights``' (a NaN or infinity in a weight is an error).

    The config, then the tokenizer (its chat template compiled), then the weights: a
    broken config or template stops the load before the long part. Raises
    ``ModelLoadError`` for a missing or unusable checkpoint, ValueError for a bad dtype.
    """
    import jax.numpy as jnp

    try:
        np_dtype = jnp.dtype(dtype)
    except TypeError:
        np_dtype = None
    if np_dtype is None or np_dtype.name not in MODEL_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; supported: {list(MODEL_DTYPES)}")
    config = read_hf_config(path)
    if isinstance(config, DeepSeekConfig) and mesh is not None and mesh.size > 1:
        raise ModelLoadError(
            f"{config.name!r} is a DeepSeek (MLA) model: it runs on one device; a mesh of {mesh.size} devices "
            "(--devices) is not supported for it"
        )
    if progress is not None:
        progress("tokenizer", 0, 1)
    tokenizer = load_hf_tokenizer(path)
    if progress is not None:
        progress("tokenizer", 1, 1)
    config, params = load_hf_weights(
        path,
        np_dtype,
        progress=None if progress is None else lambda d, t: progress("weights", d, t),
        check_finite=check_finite,
    )
    if isinstance(config, DeepSeekConfig):
        model = DeepSeekModel(
            config, block_size=block_size, kv_cache_dtype=kv_cache_dtype, attn_backend=attn_backend, dtype=np_dtype
        )
        return model, params, tokenizer
    local = {}
    if mesh is not None:
        from attn_jax.sharding import shard_model

        config, params, local = shard_model(config, params, mesh)
    model = LlamaModel(
        config, block_size=block_size, kv_cache_dtype=kv_cache_dtype, attn_backend=attn_backend, dtype=np_dtype, **local
    )
    return model, params, tokenizer
