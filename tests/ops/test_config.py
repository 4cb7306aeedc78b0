"""Tuned block-size tables (data under ops/ragged_paged_attention/tuned/) and the GPU heuristic."""

from __future__ import annotations

import json

import pytest

from attn_jax.ops.ragged_paged_attention import config

GPU_TABLES = config.tuned_tables("gpu_")


def test_there_is_an_h100_table():
    assert "NVIDIA H100 80GB HBM3" in [config.load_tuned_table(n)["device_kind"] for n in GPU_TABLES]


@pytest.mark.parametrize("name", GPU_TABLES)
def test_every_gpu_entry_validates(name):
    table = config.load_tuned_table(name)
    assert table["source"] and table["entries"]
    for entry in table["entries"]:
        bs = config.gpu_entry_block_sizes(entry)
        config.check_block_sizes(bs, group=entry["group"], page_size=entry["page_size"])
        chosen = config.gpu_block_sizes(
            num_reqs=4, pages_per_req=64, page_size=entry["page_size"], head_size=entry["head_size"],
            num_kv_heads=8, group=entry["group"], mode=entry["mode"], device_kind=table["device_kind"],
            q_dtype=entry["q_dtype"], kv_dtype=entry["kv_dtype"],
        )  # fmt: skip
        assert (chosen.block_q, chosen.pages_per_tile) == (bs.block_q, bs.pages_per_tile), "the entry is used"
        assert chosen.num_stages == bs.num_stages, "a tuned entry fits the device's shared memory as it is"


def test_the_h200_table_covers_the_engines_decode_step():
    """generate_gpu.py's SmolLM2-135M decode step (3 KV heads of 64, group 3) and D1 take the H200's
    entries (4 warps, where the heuristic gives an unsplit one-head program 8); the splits stay the
    heuristic's, by the bucket's request count."""
    h200 = "NVIDIA H200"
    smol = dict(
        pages_per_req=24, page_size=16, head_size=64, num_kv_heads=3, group=3, mode="decode", q_dtype="bfloat16"
    )
    for num_reqs in (1, 256):
        choice = config.gpu_block_choice(num_reqs=num_reqs, **smol, device_kind=h200)
        assert choice.source.startswith("tuned entry of 'NVIDIA H200'"), choice.source
        assert choice.block_sizes.num_warps == 4 and choice.block_sizes.num_kv_splits == 1
        heuristic = config.gpu_block_choice(num_reqs=num_reqs, **smol, device_kind="some other GPU").block_sizes
        assert heuristic.num_warps == 8
    d2 = config.gpu_block_choice(num_reqs=8, pages_per_req=2049, page_size=16, head_size=128, num_kv_heads=8,
                                 group=4, mode="decode", q_dtype="bfloat16", device_kind=h200)  # fmt: skip
    assert (d2.block_sizes.pages_per_tile, d2.block_sizes.num_warps, d2.block_sizes.num_kv_splits) == (8, 4, 4)


def test_a_miss_falls_back_to_the_heuristic():
    bs = config.gpu_block_sizes(num_reqs=64, pages_per_req=257, page_size=16, head_size=128, num_kv_heads=8,
                                group=4, mode="decode", q_dtype="bfloat16", device_kind="some other GPU")  # fmt: skip
    assert (bs.block_q, bs.pages_per_tile, bs.num_kv_splits) == (4, 4, 1)


def test_tuned_entries_match_on_dtypes():
    h100 = "NVIDIA H100 80GB HBM3"
    shape = dict(num_reqs=64, pages_per_req=256, page_size=16, head_size=128, num_kv_heads=8, group=4, mode="decode")
    bf16 = config.gpu_block_choice(**shape, q_dtype="bfloat16", device_kind=h100)
    assert bf16.source.startswith("tuned entry") and bf16.block_sizes.pages_per_tile == 8
    f32 = config.gpu_block_choice(**shape, q_dtype="float32", device_kind=h100)
    assert f32.source.startswith("heuristic"), f32.source
    fp8 = config.gpu_block_choice(**shape, q_dtype="bfloat16", kv_dtype="float8_e4m3fn", device_kind=h100)
    assert fp8.source.startswith("heuristic"), fp8.source


@pytest.mark.parametrize(
    ("head_size", "q_dtype", "mode", "limit"),
    [(128, "float32", "decode", 232448), (256, "float32", "mixed", 232448), (256, "float32", "mixed", 101376),
     (256, "bfloat16", "mixed", 101376), (80, "float16", "decode", 101376)],
)  # fmt: skip
def test_block_sizes_step_down_to_fit_shared_memory(head_size, q_dtype, mode, limit):
    """The failures the H100 showed (float32 at heads 128/256) and smaller GPUs' budgets:
    the choice fits, with no more steps down than it needs."""
    kind = {232448: "NVIDIA H100 80GB HBM3", 101376: "NVIDIA GeForce RTX 4090"}[limit]
    group, page = 4, 16
    choice = config.gpu_block_choice(num_reqs=8, pages_per_req=64, page_size=page, head_size=head_size,
                                      num_kv_heads=2, group=group, mode=mode, q_dtype=q_dtype,
                                      device_kind=kind)  # fmt: skip
    bs = choice.block_sizes
    dims = dict(group=group, page_size=page, head_size=head_size, q_dtype=q_dtype, kv_dtype=q_dtype)
    assert config.triton_smem_bytes(bs, **dims) <= limit
    config.check_block_sizes(bs, group=group, page_size=page)
    if "stepped down" in choice.source:  # the step before did not fit
        last = choice.source.split("; ")[-2] if choice.source.count("; ") > 1 else None
        assert last is None or "stepped down" in last or last.startswith(("heuristic", "tuned"))


def test_triton_smem_estimate_matches_what_the_h100_requested():
    """The 'requested' figures of H100 launch failures (issue 21 and the calibration run:
    float32, page 16, 4 q heads per kv head; the sweep's bfloat16 head 256 on one 128-key page)
    against the estimate: within its 1 KiB margin, never under; and 16-bit blocks that launched
    fit under it."""
    f32 = dict(group=4, page_size=16, q_dtype="float32", kv_dtype="float32")
    decode_128 = config.GpuBlockSizes(block_q=4, pages_per_tile=8, num_stages=3)
    assert config.triton_smem_bytes(decode_128, head_size=128, **f32) >= 270848
    decode_256 = config.GpuBlockSizes(block_q=4, pages_per_tile=4, num_stages=2)
    assert config.triton_smem_bytes(decode_256, head_size=256, **f32) - 1024 == 278528
    mixed_256 = config.GpuBlockSizes(block_q=16, pages_per_tile=4, num_stages=2)
    assert config.triton_smem_bytes(mixed_256, head_size=256, **f32) - 1024 == 327680
    launched = config.GpuBlockSizes(block_q=16, pages_per_tile=16, num_stages=3)  # bf16, head 128: ran
    assert (
        config.triton_smem_bytes(launched, head_size=128, **{**f32, "q_dtype": "bfloat16", "kv_dtype": "bfloat16"})
        <= 232448
    )
    one_page = config.GpuBlockSizes(block_q=64, pages_per_tile=1, num_stages=2)  # bf16, head 256, page 128: failed
    bf16 = dict(group=1, page_size=128, q_dtype="bfloat16", kv_dtype="bfloat16")
    assert config.triton_smem_bytes(one_page, head_size=256, **bf16) == 295936


def test_pages_larger_than_shared_memory_take_sub_page_tiles():
    choice = config.gpu_block_choice(num_reqs=4, pages_per_req=8, page_size=128, head_size=128, num_kv_heads=2,
                                      group=4, mode="decode", q_dtype="float32",
                                      device_kind="NVIDIA H100 80GB HBM3")  # fmt: skip
    assert choice.block_sizes.keys_per_tile == 64 and "stepped down" in choice.source
    with pytest.raises(ValueError, match=r"keys_per_tile=24 must be a power of two >= 16 below page_size=128"):
        config.check_block_sizes(config.GpuBlockSizes(4, 1, keys_per_tile=24), group=4, page_size=128)
    with pytest.raises(ValueError, match=r"keys_per_tile=32 needs pages_per_tile=1, not 2"):
        config.check_block_sizes(config.GpuBlockSizes(4, 2, keys_per_tile=32), group=4, page_size=128)


def test_bad_entries_and_modes_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"unknown keys \['block_k'\]"):
        config.gpu_entry_block_sizes({"mode": "decode", "block_k": 64})
    with pytest.raises(ValueError, match=r"mode='prefil' is not one of \['decode', 'mixed'\]"):
        config.gpu_entry_block_sizes({"mode": "prefil", "block_q": 4})
    # A prefill batch runs the mixed launch: an entry keyed "prefill" would never be read.
    with pytest.raises(ValueError, match=r"mode='prefill' is not one of .* \(a prefill batch runs the mixed launch\)"):
        config.gpu_entry_block_sizes({"mode": "prefill", "block_q": 4})
    with pytest.raises(ValueError, match=r"mode='both' is not one of"):
        config.gpu_block_sizes(num_reqs=1, pages_per_req=1, page_size=16, head_size=64, num_kv_heads=1, group=1,
                               mode="both")  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"no tuned table 'gpu_nope'"):
        config.load_tuned_table("gpu_nope")
    json.dumps(config.load_tuned_table(GPU_TABLES[0]))  # tables are plain JSON data


def test_a_tuned_entry_that_does_not_fit_is_named(monkeypatch):
    entry = {"mode": "decode", "head_size": 64, "group": 4, "page_size": 16, "q_dtype": "float32",
             "kv_dtype": "float32", "block_q": 1, "pages_per_tile": 1}  # fmt: skip
    table = {"device_kind": "X", "source": "test", "entries": [entry]}
    tables = {("gpu_", "X"): table}
    monkeypatch.setattr(config, "tuned_table_for", lambda prefix, kind: tables.get((prefix, kind)))
    with pytest.raises(ValueError, match=r"block_q=1 x kv_heads_per_program=1 gives 4 rows for a head group of 4 .*"):
        config.gpu_block_sizes(num_reqs=1, pages_per_req=4, page_size=16, head_size=64, num_kv_heads=2, group=4,
                               mode="decode", device_kind="X")  # fmt: skip


@pytest.mark.parametrize(
    ("head_size", "num_kv_heads", "pack"),
    [(80, 8, 3), (96, 8, 2), (112, 8, 2), (80, 2, 2), (80, 1, 1), (48, 8, 5), (128, 8, 1), (64, 8, 1), (192, 8, 1)],
)
def test_narrow_heads_pack_kv_heads_in_decode(head_size, num_kv_heads, pack):
    assert config.kv_heads_to_pack(head_size, num_kv_heads) == pack
    dims = dict(num_reqs=64, pages_per_req=256, page_size=16, head_size=head_size, num_kv_heads=num_kv_heads, group=4)
    decode = config.gpu_block_sizes(mode="decode", **dims)
    assert decode.kv_heads_per_program == pack and decode.rows(4) >= 16
    assert decode.rows(4) == 16 or decode.block_q == 1  # no more rows than the packed heads need
    assert config.gpu_block_sizes(mode="mixed", **dims).kv_heads_per_program == 1
