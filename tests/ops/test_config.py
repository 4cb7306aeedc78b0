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
        )  # fmt: skip
        assert (chosen.block_q, chosen.pages_per_tile) == (bs.block_q, bs.pages_per_tile), "the entry is used"


def test_a_miss_falls_back_to_the_heuristic():
    bs = config.gpu_block_sizes(num_reqs=64, pages_per_req=257, page_size=16, head_size=128, num_kv_heads=8,
                                group=4, mode="decode", device_kind="some other GPU")  # fmt: skip
    assert (bs.block_q, bs.pages_per_tile, bs.num_kv_splits) == (4, 4, 1)


def test_bad_entries_and_modes_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"unknown keys \['block_k'\]"):
        config.gpu_entry_block_sizes({"mode": "decode", "block_k": 64})
    with pytest.raises(ValueError, match=r"mode='prefil' is not one of \['decode', 'prefill', 'mixed'\]"):
        config.gpu_entry_block_sizes({"mode": "prefil", "block_q": 4})
    with pytest.raises(ValueError, match=r"mode='both' is not one of"):
        config.gpu_block_sizes(num_reqs=1, pages_per_req=1, page_size=16, head_size=64, num_kv_heads=1, group=1,
                               mode="both")  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"no tuned table 'gpu_nope'"):
        config.load_tuned_table("gpu_nope")
    json.dumps(config.load_tuned_table(GPU_TABLES[0]))  # tables are plain JSON data


def test_a_tuned_entry_that_does_not_fit_is_named(monkeypatch):
    entry = {"mode": "decode", "head_size": 64, "group": 4, "page_size": 16, "block_q": 1, "pages_per_tile": 1}
    table = {"device_kind": "X", "source": "test", "entries": [entry]}
    tables = {("gpu_", "X"): table}
    monkeypatch.setattr(config, "tuned_table_for", lambda prefix, kind: tables.get((prefix, kind)))
    with pytest.raises(ValueError, match=r"block_q=1 gives 4 rows for a head group of 4 .* needs at least 16"):
        config.gpu_block_sizes(num_reqs=1, pages_per_req=4, page_size=16, head_size=64, num_kv_heads=2, group=4,
                               mode="decode", device_kind="X")  # fmt: skip
