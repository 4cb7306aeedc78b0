"""What the serving engine needs of a model: the ``ServingModel`` Protocol and its
``AttentionGroup``.

The engine's core (``serving/engine.py``) and model runner (``serving/model_runner.py``)
reach a model only through these names, so a second family (an MLA model, say) plugs in
by satisfying them; ``LlamaModel`` does. Nothing here names a backend: a group holds
whichever backend the model's attention layers selected.

A model's layers whose attention shares one backend, one page size and one metadata
form an attention group (vLLM v1's ``AttentionGroup``): the runner builds that metadata
once per step with the group's builder and hands it to ``model.step``. The models here
have one group (every layer full attention, one backend); a model mixing kinds (sliding
window beside full attention) would return one per kind, and the runner would build one
metadata per group.

Example::

    group = model.attention_group
    prefix = group.cascade_prefix_len(common_prefix_len, query_lens)  # 0 unless cascade pays
    md = group.build_for_jit(common_md, step_query_lens=query_lens, common_prefix_len=prefix)   # on the host
    logits, caches = model.step(params, caches, token_ids, positions, md, logits_rows)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from attn_jax.backends.base import AttentionMetadataBuilder
from attn_jax.metadata import CommonAttentionMetadata


@dataclasses.dataclass(frozen=True)
class AttentionGroup:
    """Layers sharing one attention backend, page size and per-step metadata.

    Attributes:
      backend: the layers' ``AttentionBackend`` class.
      metadata_builder: the backend's builder for these layers.
      block_size: tokens per KV cache page.
      layer_names: the layers' names (vLLM's ``prefix``), for messages.
      use_alibi: the layers add ALiBi biases (cascade attention then never runs).
    """

    backend: type
    metadata_builder: AttentionMetadataBuilder
    block_size: int
    layer_names: tuple[str, ...] = ()
    use_alibi: bool = False

    def build_for_jit(
        self, common_attn_metadata: CommonAttentionMetadata, step_query_lens=None, common_prefix_len: int = 0
    ):
        """The backend's metadata with static shapes for one step (host side); with
        ``common_prefix_len`` > 0 (``cascade_prefix_len``'s) cascade attention's."""
        return self.metadata_builder.build_for_jit(
            common_attn_metadata, step_query_lens=step_query_lens, common_prefix_len=common_prefix_len
        )

    def cascade_prefix_len(
        self, common_prefix_len: int, query_lens, *, min_prefix_len: int | None = None, min_requests: int | None = None,
        seq_lens=None, performance_model: bool = True,
    ) -> int:  # fmt: skip
        """``common_prefix_len`` (tokens every request of the step shares, whole pages, before
        all its query tokens) when the builder's ``use_cascade_attention`` says cascade pays
        for the step's ``query_lens`` i32[R] (and ``seq_lens`` i32[R], each request's keys in
        the step, when known), else 0. The thresholds replace the builder's;
        ``performance_model=False`` leaves out a builder's model of the two paths' work."""
        if common_prefix_len <= 0:
            return 0
        builder = self.metadata_builder
        spec = getattr(builder, "kv_cache_spec", None)
        num_kv_heads = getattr(spec, "num_kv_heads", 1)
        use = builder.use_cascade_attention(
            common_prefix_len, np.asarray(query_lens), getattr(spec, "num_q_heads", None) or num_kv_heads,
            num_kv_heads, self.use_alibi, getattr(spec, "sliding_window", None) is not None, 0,
            min_prefix_len=min_prefix_len, min_requests=min_requests,
            seq_lens=None if seq_lens is None else np.asarray(seq_lens), performance_model=performance_model,
        )  # fmt: skip
        return int(common_prefix_len) if use else 0

    @property
    def supports_decode_advance(self) -> bool:
        """Whether ``advance_decode`` works (multi-step decoding needs it)."""
        return self.metadata_builder.supports_decode_advance

    def advance_decode(self, metadata, steps, active):
        """A decode batch's metadata ``steps`` i32[R] tokens later (traced); ``active``
        bool[R] marks the requests whose new token is written."""
        return self.metadata_builder.advance_decode(metadata, steps, active)


@runtime_checkable
class ServingConfig(Protocol):
    """The hyperparameters the engine reads (``LlamaConfig`` has them)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: Sequence[int]
    name: str


@runtime_checkable
class ServingModel(Protocol):
    """A decoder the serving engine can run: static structure only (weights, caches and
    batches are arguments), traceable ``step``.

    ``step(params, kv_caches, token_ids i32[T], positions i32[T], attn_metadata,
    logits_rows i32[N]) -> (logits f32[N, V], kv_caches)`` runs a packed batch (every
    request's new tokens on one token axis) and writes their keys and values at the
    metadata's slots; ``attn_metadata`` is what ``attention_group.build_for_jit`` built.
    ``init_kv_caches(num_blocks)`` returns the caches (any pytree of arrays; the step is
    jitted with them donated). ``dtype`` is the activation dtype.
    """

    config: ServingConfig
    block_size: int
    dtype: Any

    @property
    def attention_group(self) -> AttentionGroup: ...

    def init_kv_caches(self, num_blocks: int) -> Any: ...

    def step(self, params, kv_caches, token_ids, positions, attn_metadata, logits_rows) -> tuple[Any, Any]: ...
