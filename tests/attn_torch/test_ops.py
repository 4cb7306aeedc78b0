"""torch.ops.attn_stack.unified_attention: one opaque op under torch.compile, no graph breaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from attn_torch import Attention, bind_kv_cache, build_common_attn_metadata, set_forward_context
from attn_torch.ops import get_layer


class TinyDecoderLayer(nn.Module):
    """qkv projection -> attn_torch.Attention -> output projection (4 q heads, 2 kv heads, D=16)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 64 + 32 + 32)
        self.attn = Attention(4, 16, 0.25, 2, prefix=prefix, block_size=4)
        self.o = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split([64, 32, 32], dim=-1)
        return self.o(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model = TinyDecoderLayer("test_ops.tiny").eval()
    bind_kv_cache({"test_ops.tiny": model.attn.init_kv_cache(16)})
    md = build_common_attn_metadata([1, 3], [6, 3], np.array([[0, 1], [2, 0]]), block_size=4)
    return model, md, torch.randn(md.num_tokens, 32)


def test_op_schema_and_fake():
    op = torch.ops.attn_stack.unified_attention.default
    assert str(op._schema) == (
        "attn_stack::unified_attention(Tensor query, Tensor? key, Tensor? value, str layer_name) -> Tensor"
    )
    q = torch.empty(5, 4, 16, device="meta")
    out = torch.ops.attn_stack.unified_attention(q, q[:, :2], q[:, :2], "anything")
    assert out.shape == (5, 4, 16) and out.device.type == "meta"


def test_compile_fullgraph_has_no_graph_breaks(tiny):
    model, md, x = tiny
    with torch.no_grad(), set_forward_context(md):
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        ops = [str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert ops.count("attn_stack.unified_attention") == 1, ops
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), eager)


def test_unknown_layer_name():
    with pytest.raises(KeyError, match="No attn_torch.Attention named 'nope'"):
        get_layer("nope")
