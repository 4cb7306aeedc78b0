"""Per-batch attention metadata shared by every layer and backend, and batch utilities.

``CommonAttentionMetadata`` follows vLLM's fields and names. It is a registered pytree
whose leaves are all of its fields: a jitted step that receives it is retraced only when
an array's shape changes (the padded bucket), never for new values. Inside ``jit`` every
field, the ``_cpu`` copies and the counts included, is a tracer; host-side logic
(``split_decodes_and_prefills``, virtual batches) runs before ``jit``, on the NumPy
copies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

Array = Any  # jax.Array or np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class CommonAttentionMetadata:
    """Per-batch attention metadata (vLLM's ``CommonAttentionMetadata``).

    Requests with no new tokens (even no context) are legal padding and produce no
    rows; token rows past ``num_actual_tokens`` are padding, with slot -1.
    """

    query_start_loc: Array  # i32[num_reqs + 1], device
    query_start_loc_cpu: np.ndarray  # i32[num_reqs + 1], host
    seq_lens: Array  # i32[num_reqs], device: computed + new tokens
    seq_lens_cpu: np.ndarray  # i32[num_reqs], host
    num_computed_tokens_cpu: np.ndarray  # i32[num_reqs], host
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: Array  # i32[num_reqs, max_blocks_per_req], device
    slot_mapping: Array  # i32[num_tokens], device; -1 past num_actual_tokens

    @property
    def query_lens_cpu(self) -> np.ndarray:
        """i32[num_reqs]: new tokens per request (host)."""
        return np.diff(self.query_start_loc_cpu)

    @property
    def num_tokens(self) -> int:
        """Rows of the (padded) token axis."""
        return self.slot_mapping.shape[0]
