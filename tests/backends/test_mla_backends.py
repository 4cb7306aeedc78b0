"""The MLA backends: selection for use_mla=True on each platform (with reasons), the latent
cache shape, the decode/prefill metadata split, and each impl's forward on a mixed,
unordered batch (new latents written, decodes absorbed, prefills up-projected) against the
float64 oracle; the Pallas backends run their kernels in the interpreter here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.backends.base import AttentionSpec
from attn_jax.backends.mla_pallas import PallasMLAGPUBackend, PallasMLATPUBackend
from attn_jax.backends.mla_xla import MLAMetadata, XLAMLABackend
from attn_jax.metadata import build_common_attn_metadata
from attn_jax.platforms import Platform
from attn_jax.registry import AttentionBackendEnum as ABE
from attn_jax.selector import explain_attn_backend_selection, get_attn_backend
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import mla_prefill_oracle, sparse_mla_oracle

CPU = Platform(kind="cpu", device_kind="cpu", num_devices=1)
GPU = Platform(kind="gpu", device_kind="NVIDIA H100 80GB HBM3", num_devices=1)
TPU = Platform(kind="tpu", device_kind="TPU v6e", num_devices=1)


@pytest.mark.parametrize(
    "platform, expected", [(CPU, XLAMLABackend), (GPU, PallasMLAGPUBackend), (TPU, PallasMLATPUBackend)]
)
def test_use_mla_selects_an_mla_backend(platform, expected):
    assert get_attn_backend(576, jnp.bfloat16, block_size=64, use_mla=True, platform=platform) is expected


def test_gpu_reasons_for_a_latent_width_the_kernel_cannot_tile():
    report = explain_attn_backend_selection(100, jnp.bfloat16, block_size=64, use_mla=True, platform=GPU)
    assert report.chosen is ABE.XLA_MLA
    (reason,) = report.row(ABE.PALLAS_MLA_GPU).reasons
    assert reason.startswith("head_size=100 is not supported; supported: kv_lora_rank + 64 with kv_lora_rank a power")
    assert "serves only MLA layers" not in report.format()


def test_mla_backends_refuse_other_layers_and_sinks():
    report = explain_attn_backend_selection(128, jnp.bfloat16, platform=TPU)
    assert report.chosen is ABE.PALLAS_TPU
    assert report.row(ABE.PALLAS_MLA_TPU).reasons == ["serves only MLA layers (use_mla=True)"]
    report = explain_attn_backend_selection(576, jnp.bfloat16, kv_cache_dtype="fp8", use_mla=True, platform=CPU)
    assert report.chosen is ABE.XLA_MLA  # the fp8 latent cache (latent / k_scale)
    report = explain_attn_backend_selection(576, jnp.bfloat16, use_mla=True, has_sink=True, platform=CPU)
    assert report.chosen is None
    assert report.row(ABE.XLA_MLA).reasons == ["attention sinks are not supported"]


def test_latent_cache_shape():
    assert XLAMLABackend.get_kv_cache_shape(10, 64, 1, 576) == (10, 64, 576)
    with pytest.raises(ValueError, match=r"num_kv_heads=2: an MLA cache has one latent row per token \(valid: 1\)"):
        XLAMLABackend.get_kv_cache_shape(10, 64, 2, 576)


C, ROPE, NOPE, DV, H, S = 32, 16, 16, 16, 4, 16  # powers of two: the GPU impl takes its Triton prefill


def _builder():
    return XLAMLABackend.get_builder_cls()(AttentionSpec(block_size=S, num_kv_heads=1, head_size=C + ROPE,
                                                         dtype=jnp.float32, num_q_heads=H))  # fmt: skip


def test_builder_splits_unordered_batch():
    # prefill, decode, prefill, decode; the decodes are not first
    md = build_common_attn_metadata([3, 1, 5, 1], [3, 20, 9, 1], np.arange(8).reshape(4, 2), S)
    built = _builder().build(0, md)
    assert isinstance(built, MLAMetadata) and (built.num_decodes, built.num_prefills) == (2, 2)
    assert (built.has_decodes, built.has_prefills, built.prefill_q_block) == (True, True, 8)
    assert built.decode_rows[:2].tolist() == [3, 9] and built.decode_seq_lens[:2].tolist() == [20, 1]
    assert built.prefill_rows[:8].tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert built.prefill_query_start_loc[:3].tolist() == [0, 3, 8]
    assert set(built.prefill_rows[8:].tolist()) == {md.num_tokens}  # padding rows: dropped on scatter


def test_decode_counts_are_not_part_of_the_jit_key():
    one = _builder().build(0, build_common_attn_metadata([1, 0], [4, 0], np.arange(4).reshape(2, 2), S))
    two = _builder().build(0, build_common_attn_metadata([1, 1], [4, 7], np.arange(4).reshape(2, 2), S))
    assert jax.tree.structure(one) == jax.tree.structure(two)  # one compilation serves both


def test_builder_decode_only_has_no_prefill_part():
    md = build_common_attn_metadata([1, 1], [4, 7], np.arange(4).reshape(2, 2), S)
    built = _builder().build(0, md)
    assert (built.num_decodes, built.num_prefills, built.prefill_rows.shape) == (2, 0, (0,))
    assert (built.has_decodes, built.has_prefills) == (True, False)


@pytest.mark.parametrize("backend", [XLAMLABackend, PallasMLAGPUBackend, PallasMLATPUBackend])
def test_forward_mixed_batch_matches_oracle(backend):
    rng = np.random.default_rng(11)
    query_lens, seq_lens = [4, 1, 0, 1, 6], [4, 30, 3, 1, 21]  # prefill, decode, idle, decode at 0, chunk
    b = make_mla_batch(11, seq_lens=seq_lens, num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=S)
    md = build_common_attn_metadata(query_lens, seq_lens, b.block_tables, S)
    new = np.concatenate([lat[n - q :] for lat, q, n in zip(b.latents, query_lens, seq_lens, strict=True)])
    num_real = new.shape[0]
    cache = np.asarray(b.kv_cache).reshape(-1, C + ROPE).copy()
    cache[md.slot_mapping[:num_real]] = np.nan  # the new latents come in through forward
    cache = jnp.asarray(cache.reshape(b.kv_cache.shape))
    pad = md.num_tokens - num_real
    kv_c = jnp.asarray(np.pad(new[:, :C], ((0, pad), (0, 0)), constant_values=7.0))
    k_pe = jnp.asarray(np.pad(new[:, C:], ((0, pad), (0, 0)), constant_values=7.0))
    q = rng.standard_normal((md.num_tokens, H, NOPE + ROPE)).astype(np.float32)
    w_uk = (rng.standard_normal((C, H, NOPE)) * C**-0.5).astype(np.float32)
    w_uv = (rng.standard_normal((C, H, DV)) * C**-0.5).astype(np.float32)
    scale = (NOPE + ROPE) ** -0.5
    impl = backend.get_impl_cls()(H, C + ROPE, scale, kv_lora_rank=C, qk_nope_head_dim=NOPE,
                                  qk_rope_head_dim=ROPE, v_head_dim=DV)  # fmt: skip
    built = _builder().build(0, md)
    out, new_cache = impl.forward(jnp.asarray(q), kv_c, k_pe, cache, built, w_uk=jnp.asarray(w_uk),
                                  w_uv=jnp.asarray(w_uv))  # fmt: skip
    want, _ = mla_prefill_oracle(q, b.latents, w_uk, w_uv, query_lens, sm_scale=scale)
    np.testing.assert_allclose(np.asarray(out)[:num_real], want[:num_real], atol=3e-5, rtol=3e-5)
    written = np.asarray(new_cache).reshape(-1, C + ROPE)[md.slot_mapping[:num_real]]
    np.testing.assert_array_equal(written, new)


def test_gpu_impl_hands_its_device_kind_to_the_triton_decode(monkeypatch):
    """The device kind is read once at the edge (the impl) and reaches the op, whose default
    blocks depend on the device's shared memory (``pallas_triton.default_block_sizes``)."""
    from attn_jax.backends import mla_pallas
    from attn_jax.ops.mla import pallas_triton

    monkeypatch.setattr(mla_pallas, "current_platform", lambda: GPU)
    seen = {}
    monkeypatch.setattr(pallas_triton, "mla_decode", lambda *a, **k: seen.update(k))
    impl = PallasMLAGPUBackend.get_impl_cls()(H, C + ROPE, 0.1, kv_lora_rank=C, qk_nope_head_dim=NOPE,
                                              qk_rope_head_dim=ROPE, v_head_dim=DV)  # fmt: skip
    impl.decode(jnp.zeros((2, H, C + ROPE)), jnp.zeros((4, S, C + ROPE)), jnp.ones(2, jnp.int32),
                jnp.zeros((2, 1), jnp.int32))  # fmt: skip
    assert seen["device_kind"] == GPU.device_kind


def test_impl_rejects_unsupported_options():
    with pytest.raises(NotImplementedError, match=r"sliding_window=8: MLA backends support none of"):
        XLAMLABackend.get_impl_cls()(H, C + ROPE, 0.1, sliding_window=8, kv_lora_rank=C, qk_nope_head_dim=NOPE,
                                     qk_rope_head_dim=ROPE, v_head_dim=DV)  # fmt: skip
    with pytest.raises(ValueError, match=r"head_size=40 must be kv_lora_rank \+ qk_rope_head_dim = 32 \+ 16 = 48"):
        XLAMLABackend.get_impl_cls()(H, 40, 0.1, kv_lora_rank=C, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                     v_head_dim=DV)  # fmt: skip


def test_use_sparse_selection():
    assert get_attn_backend(576, jnp.bfloat16, block_size=64, use_mla=True, use_sparse=True, platform=GPU) is (
        PallasMLAGPUBackend
    )
    report = explain_attn_backend_selection(576, jnp.bfloat16, block_size=64, use_mla=True, use_sparse=True,
                                            platform=TPU)  # fmt: skip
    assert report.chosen is ABE.XLA_MLA
    assert report.row(ABE.PALLAS_MLA_TPU).reasons == ["sparse attention is not supported"]


@pytest.mark.parametrize("backend", [XLAMLABackend, PallasMLAGPUBackend])
def test_sparse_forward_matches_oracle(backend):
    rng = np.random.default_rng(12)
    query_lens, seq_lens = [4, 1, 6], [4, 30, 21]
    b = make_mla_batch(12, seq_lens=seq_lens, num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=S)
    md = build_common_attn_metadata(query_lens, seq_lens, b.block_tables, S)
    new = np.concatenate([lat[n - q :] for lat, q, n in zip(b.latents, query_lens, seq_lens, strict=True)])
    pad = md.num_tokens - new.shape[0]
    topk = np.full((md.num_tokens, 8), -1, np.int32)
    row = 0
    for q_len, n in zip(query_lens, seq_lens, strict=True):
        for i in range(q_len):
            chosen = rng.permutation(n - q_len + i + 1)[:8]
            topk[row, : chosen.size] = chosen
            row += 1
    q = rng.standard_normal((md.num_tokens, H, NOPE + ROPE)).astype(np.float32)
    w_uk = (rng.standard_normal((C, H, NOPE)) * C**-0.5).astype(np.float32)
    w_uv = (rng.standard_normal((C, H, DV)) * C**-0.5).astype(np.float32)
    impl = backend.get_impl_cls()(H, C + ROPE, 0.2, kv_lora_rank=C, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                  v_head_dim=DV)  # fmt: skip
    out, _ = impl.forward(
        jnp.asarray(q), jnp.asarray(np.pad(new[:, :C], ((0, pad), (0, 0)))),
        jnp.asarray(np.pad(new[:, C:], ((0, pad), (0, 0)))), b.kv_cache, _builder().build(0, md),
        w_uk=jnp.asarray(w_uk), w_uv=jnp.asarray(w_uv), topk_positions=topk,
    )  # fmt: skip
    q_abs = np.concatenate([np.einsum("thd,chd->thc", q[..., :NOPE], w_uk), q[..., NOPE:]], axis=-1)
    lat, _ = sparse_mla_oracle(q_abs, b.latents, topk, query_lens, kv_lora_rank=C, sm_scale=0.2)
    want = np.einsum("thc,chd->thd", lat, w_uv)
    n = sum(query_lens)
    np.testing.assert_allclose(np.asarray(out)[:n], want[:n], atol=3e-5, rtol=3e-5)


@pytest.mark.gpu
def test_gpu_impl_decodes_on_mosaic_gpu_for_a_deepseek_batch(monkeypatch):
    """16 decode requests of DeepSeek-V3's shape (128 heads, latent 512 + 64, page 64) go through
    PALLAS_MLA_GPU's Mosaic GPU decode on Hopper and match XLA_MLA on the same inputs."""
    from attn_jax.ops.ragged_paged_attention.config import mgpu_prefill_available

    if jax.default_backend() != "gpu" or not mgpu_prefill_available(jax.devices()[0].device_kind):
        pytest.skip("needs a Hopper GPU (H100/H200) for Mosaic GPU")
    from attn_jax.backends.mla_pallas import MGPU_MLA_DECODE_MIN_REQS
    from attn_jax.ops.mla import decode_pallas_mosaic_gpu

    calls = []
    real = decode_pallas_mosaic_gpu.mla_decode
    monkeypatch.setattr(decode_pallas_mosaic_gpu, "mla_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    c, rope, nope, dv, h, page = 512, 64, 128, 128, 128, 64
    n = MGPU_MLA_DECODE_MIN_REQS
    rng = np.random.default_rng(5)
    seq_lens = rng.integers(1, 700, size=n).tolist()
    b = make_mla_batch(5, seq_lens=seq_lens, num_heads=h, kv_lora_rank=c, rope_dim=rope, block_size=page,
                       dtype=jnp.bfloat16)  # fmt: skip
    md = build_common_attn_metadata([1] * n, seq_lens, b.block_tables, page)
    new = np.stack([lat[-1] for lat in b.latents])
    kv_c, k_pe = jnp.asarray(new[:, :c], jnp.bfloat16), jnp.asarray(new[:, c:], jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((md.num_tokens, h, nope + rope)), jnp.bfloat16)
    w_uk = jnp.asarray(rng.standard_normal((c, h, nope)) * c**-0.5, jnp.bfloat16)
    w_uv = jnp.asarray(rng.standard_normal((c, h, dv)) * c**-0.5, jnp.bfloat16)
    spec = AttentionSpec(block_size=page, num_kv_heads=1, head_size=c + rope, dtype=jnp.bfloat16, num_q_heads=h)
    built = XLAMLABackend.get_builder_cls()(spec).build(0, md)
    outs = []
    for backend in (PallasMLAGPUBackend, XLAMLABackend):
        impl = backend.get_impl_cls()(h, c + rope, (nope + rope) ** -0.5, kv_lora_rank=c, qk_nope_head_dim=nope,
                                      qk_rope_head_dim=rope, v_head_dim=dv)  # fmt: skip
        out, _ = impl.forward(q, kv_c, k_pe, b.kv_cache, built, w_uk=w_uk, w_uv=w_uv)
        outs.append(np.asarray(out.astype(jnp.float32), np.float64)[:n])
    assert calls, "PALLAS_MLA_GPU did not take the Mosaic GPU decode"
    assert np.isfinite(outs[0]).all()
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-2, rtol=2e-2)
