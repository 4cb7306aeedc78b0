"""Tests for attn_jax.metadata: batch utilities, validation and the bucketed builder."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax import metadata as md_mod
from attn_jax.metadata import (
    KV_CACHE_LAYOUT_ENV,
    CommonAttentionMetadata,
    MetadataBuckets,
    PerLayerParameters,
    build_common_attn_metadata,
    get_kv_cache_layout,
    get_per_layer_parameters,
    infer_global_hyperparameters,
    make_local_attention_virtual_batches,
    reorder_batch_to_split_decodes_and_prefills,
    set_kv_cache_layout,
    split_decodes_and_prefills,
    validate_common_metadata,
)

FAST = settings(max_examples=40, deadline=None)


def qsl_of(query_lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)


def distinct_table(num_reqs: int, width: int) -> np.ndarray:
    """Row r holds r * width + [0, width): every entry names its (request, page)."""
    return np.arange(num_reqs * width, dtype=np.int32).reshape(num_reqs, width)


# ------------------------------------------------------------------ virtual batches


@pytest.mark.parametrize("as_jax", [False, True], ids=["numpy", "jax"])
def test_local_attention_seed_worked_example(as_jax):
    block_table = distinct_table(3, 10)  # rows 0..9, 10..19, 20..29
    if as_jax:
        block_table = jnp.asarray(block_table)
    q_local, cu_q_local, k_local, bt_local = make_local_attention_virtual_batches(
        4, qsl_of([4, 10, 5]), np.array([6, 17, 9], np.int32), block_table, block_size=2
    )
    np.testing.assert_array_equal(q_local, [2, 2, 1, 4, 4, 1, 4, 1])
    np.testing.assert_array_equal(cu_q_local, [0, 2, 4, 5, 9, 13, 14, 18, 19])
    np.testing.assert_array_equal(k_local, [4, 2, 4, 4, 4, 1, 4, 1])
    expected_rows = [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]
    np.testing.assert_array_equal(np.asarray(bt_local), expected_rows)
    assert isinstance(bt_local, jax.Array) == as_jax
    for a in (q_local, cu_q_local, k_local):
        assert a.dtype == np.int32
    # new tokens in each request's first chunk [2, 1, 4] and chunks per request [2, 4, 2]
    np.testing.assert_array_equal(q_local[[0, 2, 6]], [2, 1, 4])
    # virtual keys start at [0, 4, 4, 8, 12, 16, 4, 8]: the first page of each row
    np.testing.assert_array_equal(np.asarray(bt_local)[:, 0] % 10 * 2, [0, 4, 4, 8, 12, 16, 4, 8])


def test_local_attention_zero_query_requests():
    # request 1 is padding (no context), request 3 has context but no new tokens
    q_lens, seq_lens = [3, 0, 2, 0], np.array([5, 0, 2, 7], np.int32)
    q_local, cu_q_local, k_local, bt_local = make_local_attention_virtual_batches(
        4, qsl_of(q_lens), seq_lens, distinct_table(4, 4), block_size=2
    )
    # request 0 (positions 2..4) spans chunks 0 and 1; each empty request gives one
    # empty virtual request whose block row is its first pages.
    np.testing.assert_array_equal(q_local, [2, 1, 0, 2, 0])
    np.testing.assert_array_equal(k_local, [4, 1, 0, 2, 0])
    np.testing.assert_array_equal(cu_q_local, [0, 2, 3, 3, 5, 5])
    np.testing.assert_array_equal(bt_local, [[0, 1], [2, 3], [4, 5], [8, 9], [12, 13]])


def test_local_attention_empty_batch():
    out = make_local_attention_virtual_batches(
        4, np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 2), np.int32), 2
    )
    assert [a.shape for a in out] == [(0,), (1,), (0,), (0, 2)]


@st.composite
def chunked_batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    chunk = block_size * draw(st.integers(1, 4))
    num_reqs = draw(st.integers(1, 6))
    q_lens = draw(st.lists(st.integers(0, 20), min_size=num_reqs, max_size=num_reqs))
    context = draw(st.lists(st.integers(0, 20), min_size=num_reqs, max_size=num_reqs))
    seq_lens = np.array(q_lens, np.int32) + np.array(context, np.int32)
    width = -(-int(seq_lens.max()) // block_size) + draw(st.integers(0, 2)) or 1
    return chunk, block_size, np.array(q_lens, np.int32), seq_lens, width


@FAST
@given(chunked_batches())
def test_local_attention_properties(batch):
    chunk, block_size, q_lens, seq_lens, width = batch
    table = distinct_table(len(q_lens), width)
    q_local, cu_q_local, k_local, bt_local = make_local_attention_virtual_batches(
        chunk, qsl_of(q_lens), seq_lens, table, block_size
    )
    np.testing.assert_array_equal(cu_q_local, qsl_of(q_local))
    assert bt_local.shape == (len(q_local), chunk // block_size)
    assert np.all(k_local <= chunk) and np.all(q_local <= k_local)
    # Recover, from the outputs alone, the (request, position) of every virtual query
    # token and the first key it sees; the first page id names request and k start.
    seen = []
    for v in range(len(q_local)):
        req, first_page = divmod(int(bt_local[v, 0]), width)
        k_start = first_page * block_size
        for i in range(q_local[v]):
            p = k_start + k_local[v] - q_local[v] + i
            seen.append((req, p))
            # causal within the virtual request: keys [k_start, p], the token's chunk
            assert k_start == p // chunk * chunk
        used_pages = -(-(k_start + int(k_local[v])) // block_size) - first_page
        np.testing.assert_array_equal(bt_local[v, :used_pages], table[req, first_page : first_page + used_pages])
    real = [(r, int(seq_lens[r] - q_lens[r]) + i) for r in range(len(q_lens)) for i in range(q_lens[r])]
    assert seen == real  # every real query token exactly once, in order
    # virtual requests with no queries come only from requests with no new tokens
    assert np.count_nonzero(q_local == 0) == np.count_nonzero(q_lens == 0)
    assert np.all(k_local[q_local == 0] == 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"attn_chunk_size": 6, "block_size": 4},
            "attn_chunk_size=6 must be a multiple of block_size=4",
        ),
        ({"attn_chunk_size": 0}, "attn_chunk_size=0 must be a positive integer"),
        ({"block_size": 0}, "block_size=0 must be a positive integer"),
        ({"query_start_loc_np": np.array([1, 2, 3])}, r"query_start_loc_np\[0\]=1 must be 0"),
        (
            {"query_start_loc_np": np.array([0, 3, 2])},
            r"non-decreasing: query_start_loc_np\[2\]=2 < query_start_loc_np\[1\]=3",
        ),
        (
            {"seq_lens_np": np.array([2, 1])},
            r"seq_lens_np\[1\]=1 is less than request 1's query length 2",
        ),
        ({"seq_lens_np": np.array([2, 2, 2])}, r"seq_lens_np has shape \(3,\); .* implies \(2,\)"),
        (
            {"block_table": np.zeros((2, 1), np.int32)},
            r"block_table has 1 pages per request; request 1 needs 2 \(seq_len 3, block_size=2\)",
        ),
        ({"block_table": np.zeros((2, 0), np.int32)}, r"shape \(2, 0\); it needs >= 1 page column"),
        (
            {"block_table": np.zeros((3, 2), np.int32)},
            r"block_table has shape \(3, 2\); expected \(2, pages\)",
        ),
    ],
)
def test_local_attention_errors(kwargs, match):
    args = dict(
        attn_chunk_size=4,
        query_start_loc_np=np.array([0, 1, 3]),
        seq_lens_np=np.array([2, 3]),
        block_table=np.zeros((2, 2), np.int32),
        block_size=2,
    )
    with pytest.raises(ValueError, match=match):
        make_local_attention_virtual_batches(**{**args, **kwargs})


# ------------------------------------------------------------------ split / reorder


def md_from_query_lens(query_lens, request_buckets=(1, 2, 4, 8, 16)) -> CommonAttentionMetadata:
    q = np.array(query_lens, np.int32)
    buckets = MetadataBuckets(request_buckets=request_buckets)
    return build_common_attn_metadata(q, q + 3, np.zeros((len(q), 4), np.int32), 16, buckets)


@pytest.mark.parametrize(
    "query_lens, threshold, expected",
    [
        ([1, 1, 1], 1, (3, 0, 3, 0)),  # decode-only, padded to 4 requests
        ([5, 7], 1, (0, 2, 0, 12)),  # prefill-only
        ([1, 1, 5, 9, 2], 1, (2, 3, 2, 16)),  # mixed; 3 padding requests at the tail
        ([1, 0, 1, 6], 1, (3, 1, 2, 6)),  # a zero-length request before prefills is a decode
        ([2, 1, 3, 4], 2, (2, 2, 3, 7)),  # threshold 2
        ([0, 0, 0], 1, (0, 0, 0, 0)),  # all padding
        ([], 1, (0, 0, 0, 0)),
    ],
)
def test_split_decodes_and_prefills(query_lens, threshold, expected):
    md = md_from_query_lens(query_lens)
    assert split_decodes_and_prefills(md, decode_threshold=threshold) == expected


def test_split_padding_at_tail_counts_as_neither():
    md = md_from_query_lens([1, 7, 0, 0])  # explicit padding after a prefill
    assert md.num_reqs == 4
    assert split_decodes_and_prefills(md) == (1, 1, 1, 7)


def test_split_not_reordered_names_request():
    md = md_from_query_lens([1, 4, 1, 5])
    with pytest.raises(
        ValueError,
        match=r"request 2 \(query_len=1 <= decode_threshold=1\) is a decode after prefill "
        r"request 1",
    ):
        split_decodes_and_prefills(md)


def test_split_zero_length_between_prefills_is_an_error():
    md = md_from_query_lens([4, 0, 5])
    with pytest.raises(ValueError, match=r"request 1 \(query_len=0"):
        split_decodes_and_prefills(md)


def test_split_bad_threshold():
    with pytest.raises(ValueError, match="decode_threshold=0 must be >= 1"):
        split_decodes_and_prefills(md_from_query_lens([1]), decode_threshold=0)


class FakeBatch:
    def __init__(self, req_ids):
        self.req_ids = list(req_ids)
        self.swaps = []

    def swap_states(self, i, j):
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.swaps.append((i, j))


@dataclasses.dataclass
class FakeSchedulerOutput:
    num_scheduled_tokens: dict


def test_reorder_seed_scheme():
    tokens = {"a": 5, "b": 1, "c": 7, "d": 1, "e": 1}
    batch = FakeBatch("abcde")
    assert reorder_batch_to_split_decodes_and_prefills(batch, FakeSchedulerOutput(tokens))
    # the decode furthest back (e) goes to the first prefill (a), then d to c
    assert batch.swaps == [(0, 4), (2, 3)]
    assert batch.req_ids == list("ebdca")


def test_reorder_already_split_makes_no_swap():
    batch = FakeBatch("abc")
    out = FakeSchedulerOutput({"a": 1, "b": 1, "c": 9})
    assert not reorder_batch_to_split_decodes_and_prefills(batch, out)
    assert batch.swaps == []


@FAST
@given(st.lists(st.integers(0, 5), max_size=12), st.integers(1, 3))
def test_reorder_then_split(token_counts, threshold):
    ids = [f"r{i}" for i in range(len(token_counts))]
    tokens = dict(zip(ids, token_counts, strict=True))
    batch = FakeBatch(ids)
    modified = reorder_batch_to_split_decodes_and_prefills(batch, FakeSchedulerOutput(tokens), threshold)
    assert sorted(batch.req_ids) == sorted(ids)
    assert modified == (batch.req_ids != ids)
    is_decode = [tokens[r] <= threshold for r in batch.req_ids]
    assert is_decode == sorted(is_decode, reverse=True)
    new_lens = [tokens[r] for r in batch.req_ids]
    num_decodes = sum(is_decode)
    # split agrees, except that the padding rule drops trailing zero-length requests
    live = max((i + 1 for i, n in enumerate(new_lens) if n), default=0)
    assert split_decodes_and_prefills(md_from_query_lens(new_lens), threshold) == (
        min(num_decodes, live),
        live - min(num_decodes, live),
        sum(new_lens[:num_decodes]),
        sum(new_lens[num_decodes:]),
    )


def test_reorder_unknown_request():
    with pytest.raises(ValueError, match=r"Request 'x' \(batch row 1\) has no entry"):
        reorder_batch_to_split_decodes_and_prefills(FakeBatch("ax"), FakeSchedulerOutput({"a": 1}))


# ------------------------------------------------------------------ KV cache layout


@pytest.fixture
def clean_layout(monkeypatch):
    monkeypatch.delenv(KV_CACHE_LAYOUT_ENV, raising=False)
    set_kv_cache_layout(None)
    yield monkeypatch
    set_kv_cache_layout(None)


def test_kv_cache_layout_precedence(clean_layout):
    assert get_kv_cache_layout() == "NHD"
    clean_layout.setenv(KV_CACHE_LAYOUT_ENV, "HND")
    assert get_kv_cache_layout() == "HND"  # read at call time, not cached
    set_kv_cache_layout("NHD")
    assert get_kv_cache_layout() == "NHD"  # the override wins over the env
    set_kv_cache_layout(None)
    assert get_kv_cache_layout() == "HND"
    clean_layout.setenv(KV_CACHE_LAYOUT_ENV, "")
    assert get_kv_cache_layout() == "NHD"  # empty counts as unset


def test_kv_cache_layout_invalid_env(clean_layout):
    clean_layout.setenv(KV_CACHE_LAYOUT_ENV, "nhd")
    with pytest.raises(
        ValueError,
        match=rf"{KV_CACHE_LAYOUT_ENV}: Invalid KV cache layout: 'nhd'. "
        "Valid options are: NHD, HND",
    ):
        get_kv_cache_layout()


def test_kv_cache_layout_invalid_override(clean_layout):
    with pytest.raises(ValueError, match="Invalid KV cache layout: 'NDH'. Valid options are: NHD, HND"):
        set_kv_cache_layout("NDH")
    assert get_kv_cache_layout() == "NHD"


# ------------------------------------------------------------------ per-layer parameters


@dataclasses.dataclass
class FakeImpl:
    scale: float = 0.125
    sliding_window: int | None = None
    logits_soft_cap: float | None = None


class OtherImpl(FakeImpl):
    pass


@dataclasses.dataclass
class FakeLayer:
    impl: object


def test_per_layer_parameters():
    layers = {
        "l0": FakeLayer(FakeImpl(sliding_window=128, logits_soft_cap=30.0)),
        "l1": FakeLayer(FakeImpl()),
    }
    params = get_per_layer_parameters(layers, FakeImpl)
    assert params == {
        "l0": PerLayerParameters(window_left=127, logits_soft_cap=30.0, sm_scale=0.125),
        "l1": PerLayerParameters(window_left=-1, logits_soft_cap=None, sm_scale=0.125),
    }


def test_per_layer_parameters_wrong_impl_class():
    layers = {"l0": FakeLayer(OtherImpl()), "l1": FakeLayer(FakeImpl())}
    get_per_layer_parameters(layers, FakeImpl)  # a subclass is fine
    with pytest.raises(TypeError, match="Layer 'l1' has impl of type FakeImpl; expected an instance of OtherImpl"):
        get_per_layer_parameters(layers, OtherImpl)


def test_per_layer_parameters_missing_impl():
    with pytest.raises(TypeError, match=r"Layer 'x' \(object\) has no .impl"):
        get_per_layer_parameters({"x": object()})


def test_per_layer_parameters_bad_window():
    with pytest.raises(ValueError, match="Layer 'l0': sliding_window=0 must be >= 1 or None"):
        get_per_layer_parameters({"l0": FakeLayer(FakeImpl(sliding_window=0))})


def test_infer_global_hyperparameters():
    p = PerLayerParameters(-1, None, 0.5)
    assert infer_global_hyperparameters({"a": p, "b": PerLayerParameters(-1, None, 0.5)}) == p
    with pytest.raises(ValueError, match="No attention layers"):
        infer_global_hyperparameters({})
    q = PerLayerParameters(3, None, 0.5)
    with pytest.raises(ValueError, match=r"layer 'c' has .*window_left=3.*, but layer 'a' has .*window_left=-1"):
        infer_global_hyperparameters({"a": p, "b": p, "c": q, "d": q})


# ------------------------------------------------------------------ builder


def oracle_slots(query_lens, seq_lens, block_table, block_size):
    """The slot of every real token, one request at a time."""
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for p in range(s - q, s):
            slots.append(block_table[r][p // block_size] * block_size + p % block_size)
    return slots


SMALL_BUCKETS = MetadataBuckets(
    token_buckets=(8, 16, 64, 128),
    request_buckets=(2, 4, 8),
    blocks_per_request_buckets=(2, 5, 16, 64),
)


@st.composite
def raw_batches(draw):
    block_size = draw(st.sampled_from([1, 3, 4, 16]))
    num_reqs = draw(st.integers(0, 8))
    q = np.array(draw(st.lists(st.integers(0, 15), min_size=num_reqs, max_size=num_reqs)), np.int32)
    ctx = np.array(draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs)), np.int32)
    seq = q + ctx
    need = -(-int(seq.max()) // block_size) if num_reqs else 0
    width = max(1, need + draw(st.integers(0, 20)))
    seed = draw(st.integers(0, 2**16))
    table = np.random.default_rng(seed).integers(0, 1000, (num_reqs, width), dtype=np.int32)
    return q, seq, table, block_size


@FAST
@given(raw_batches())
def test_build_matches_oracle(batch):
    q, seq, table, block_size = batch
    md = build_common_attn_metadata(q, seq, table, block_size, SMALL_BUCKETS)
    num_reqs, real_tokens = len(q), int(q.sum())
    need = -(-int(seq.max()) // block_size) if num_reqs else 0
    # shapes are the smallest buckets that fit
    assert md.num_reqs == min(b for b in SMALL_BUCKETS.request_buckets if b >= num_reqs)
    assert md.num_tokens == min(b for b in SMALL_BUCKETS.token_buckets if b >= real_tokens)
    pages = min(b for b in SMALL_BUCKETS.blocks_per_request_buckets if b >= need)
    assert md.block_table_tensor.shape == (md.num_reqs, pages)
    for a in (
        md.query_start_loc,
        md.seq_lens,
        md.num_computed_tokens_cpu,
        md.block_table_tensor,
        md.slot_mapping,
    ):
        assert a.dtype == np.int32
    # real rows untouched
    np.testing.assert_array_equal(md.query_start_loc_cpu[: num_reqs + 1], qsl_of(q))
    np.testing.assert_array_equal(md.seq_lens_cpu[:num_reqs], seq)
    np.testing.assert_array_equal(md.num_computed_tokens_cpu[:num_reqs], seq - q)
    w = min(pages, table.shape[1])
    np.testing.assert_array_equal(md.block_table_tensor[:num_reqs, :w], table[:, :w])
    assert np.all(md.block_table_tensor[:num_reqs, w:] == 0)
    np.testing.assert_array_equal(md.slot_mapping[:real_tokens], oracle_slots(q, seq, table, block_size))
    assert md.num_actual_tokens == real_tokens
    assert md.max_query_len == (int(q.max()) if num_reqs else 0)
    # padding as specified
    assert np.all(md.query_start_loc_cpu[num_reqs:] == real_tokens)
    assert np.all(md.seq_lens_cpu[num_reqs:] == 0)
    assert np.all(md.num_computed_tokens_cpu[num_reqs:] == 0)
    assert np.all(md.block_table_tensor[num_reqs:] == 0)
    assert np.all(md.slot_mapping[real_tokens:] == -1)
    validate_common_metadata(md, num_blocks=1000, block_size=block_size)


def test_default_buckets():
    b = MetadataBuckets()
    assert b.token_buckets == tuple(2**k for k in range(4, 14))
    assert b.request_buckets == tuple(2**k for k in range(0, 11))
    assert b.blocks_per_request_buckets == tuple(2**k for k in range(0, 12))
    assert MetadataBuckets(token_buckets=[4, 8]).token_buckets == (4, 8)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("token_buckets", (), r"token_buckets=\(\) must be a non-empty sequence"),
        ("request_buckets", (4, 2), r"request_buckets=\(4, 2\) must be strictly increasing"),
        ("request_buckets", (2, 2), r"request_buckets=\(2, 2\) must be strictly increasing"),
        (
            "blocks_per_request_buckets",
            (0, 4),
            r"blocks_per_request_buckets=\(0, 4\) must be positive",
        ),
        ("token_buckets", (16.0,), r"token_buckets=\(16.0,\) must hold only ints"),
    ],
)
def test_bucket_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        MetadataBuckets(**{field: value})


def _build(**overrides):
    args = dict(
        query_lens=np.array([2, 1]),
        seq_lens=np.array([2, 5]),
        block_table=np.zeros((2, 2), np.int32),
        block_size=4,
        buckets=SMALL_BUCKETS,
    )
    return build_common_attn_metadata(**{**args, **overrides})


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"query_lens": np.array([2, -1])}, r"query_lens\[1\]=-1 must be >= 0"),
        (
            {"seq_lens": np.array([1, 5])},
            r"seq_lens\[0\]=1 is less than request 0's query length 2",
        ),
        (
            {"seq_lens": np.array([2, -3])},
            r"seq_lens\[1\]=-3 is less than request 1's query length 1",
        ),
        (
            {"seq_lens": np.array([2, 9])},
            r"block_table has 2 pages per request; request 1 needs 3 \(seq_len 9, block_size=4\)",
        ),
        ({"block_size": 0}, "block_size=0 must be a positive integer"),
        (
            {"query_lens": np.array([2, 1, 1])},
            r"query_lens \(3,\), seq_lens \(2,\) and block_table \(2, 2\) must agree",
        ),
        ({"query_lens": np.array([[2, 1]])}, r"query_lens must be 1-D, got shape \(1, 2\)"),
        ({"block_table": np.zeros(2, np.int32)}, r"block_table must be 2-D, got shape \(2,\)"),
        ({"seq_lens": np.array([2.0, 5.0])}, "seq_lens must hold integers, got dtype float64"),
        (
            {"block_table": np.array([[3, 2**32 + 3], [1, 0]], np.int64)},
            r"block_table\[0, 1\]=4294967299 is outside int32's range \[-2147483648, 2147483647\]: .*never narrowed",
        ),
        ({"seq_lens": np.array([2, 2**31], np.uint64)}, r"seq_lens\[1\]=2147483648 is outside int32's range"),
        (
            {
                "query_lens": np.array([100, 100]),
                "seq_lens": np.array([100, 100]),
                "block_table": np.zeros((2, 7), np.int32),
                "block_size": 16,
            },
            "num_tokens=200 exceeds the largest bucket 128",
        ),
        (
            {
                "query_lens": np.ones(9, np.int32),
                "seq_lens": np.ones(9, np.int32),
                "block_table": np.zeros((9, 1), np.int32),
            },
            "num_reqs=9 exceeds the largest bucket 8",
        ),
        (
            {"seq_lens": np.array([2, 260]), "block_table": np.zeros((2, 65), np.int32)},
            "blocks per request=65 exceeds the largest bucket 64",
        ),
    ],
)
def test_build_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        _build(**overrides)


def test_build_accepts_lists_and_slices_wide_tables():
    md = build_common_attn_metadata([3, 1], [3, 6], [[4, 0, 9, 9, 9, 9], [7, 2, 9, 9, 9, 9]], 4)
    assert md.block_table_tensor.shape == (2, 2)
    np.testing.assert_array_equal(md.slot_mapping[:5], [16, 17, 18, 9, -1])


def test_jit_compiles_once_per_bucket():
    traces = []

    @jax.jit
    def step(md: CommonAttentionMetadata):
        traces.append(1)
        return md.slot_mapping.sum() + md.block_table_tensor.sum() + md.num_actual_tokens

    a = build_common_attn_metadata([1, 1, 30], [10, 20, 30], np.arange(6).reshape(3, 2), 16)
    b = build_common_attn_metadata([20, 5, 1], [25, 9, 3], np.arange(6).reshape(3, 2) + 3, 16)
    assert (a.num_tokens, a.num_reqs, a.block_table_tensor.shape) == (
        b.num_tokens,
        b.num_reqs,
        b.block_table_tensor.shape,
    )
    assert a.num_actual_tokens != b.num_actual_tokens
    step(a)
    step(b)
    assert len(traces) == 1
    assert step._cache_size() == 1


# ------------------------------------------------------------------ validation


def valid_md() -> CommonAttentionMetadata:
    # request 0: 3 new tokens of 6, request 1: 1 of 4; slots [15, 20, 21, 7], 8 token rows
    table = np.array([[3, 5], [1, 0]], np.int32)
    return build_common_attn_metadata([3, 1], [6, 4], table, 4, SMALL_BUCKETS)


def test_validate_accepts_built_metadata():
    md = valid_md()
    validate_common_metadata(md)
    validate_common_metadata(md, num_blocks=6, block_size=4)
    np.testing.assert_array_equal(md.slot_mapping, [15, 20, 21, 7, -1, -1, -1, -1])
    # unused block-table entries may hold anything
    padded = build_common_attn_metadata([3, 1, 0], [6, 4, 0], np.array([[3, 5], [1, 0], [0, 0]]), 4)
    bt = padded.block_table_tensor.copy()
    bt[1, 1] = -7  # request 1 (seq_len 4) uses only page 0
    bt[2:] = 99  # the empty request and the padding request
    validate_common_metadata(_with(padded, block_table_tensor=bt), num_blocks=6, block_size=4)


def _with(md, **arrays):
    return dataclasses.replace(md, **arrays)


def _set(a, index, value):
    a = np.array(a)
    a[index] = value
    return a


@pytest.mark.parametrize(
    "change, kwargs, match",
    [
        (
            lambda m: _with(m, query_start_loc_cpu=m.query_start_loc_cpu[:-1]),
            {},
            r"query_start_loc_cpu has shape \(2,\); expected \(3,\) \(num_reqs=2\)",
        ),
        (
            lambda m: _with(m, seq_lens=m.seq_lens[:1], seq_lens_cpu=m.seq_lens_cpu[:1]),
            {},
            r"seq_lens_cpu has shape \(1,\); expected \(2,\)",
        ),
        (
            lambda m: _with(m, num_computed_tokens_cpu=np.zeros(3, np.int32)),
            {},
            r"num_computed_tokens_cpu has shape \(3,\)",
        ),
        (
            lambda m: _with(m, block_table_tensor=np.zeros((3, 2), np.int32)),
            {},
            r"block_table_tensor has shape \(3, 2\); expected \(2, pages\)",
        ),
        (
            lambda m: _with(m, slot_mapping=np.zeros((4, 4), np.int32)),
            {},
            r"slot_mapping has shape \(4, 4\)",
        ),
        (
            lambda m: _with(m, query_start_loc_cpu=_set(m.query_start_loc_cpu, 0, 1)),
            {},
            r"query_start_loc_cpu\[0\]=1 must be 0",
        ),
        (
            lambda m: _with(m, query_start_loc_cpu=np.array([0, 3, 2], np.int32)),
            {},
            r"non-decreasing: query_start_loc_cpu\[2\]=2 < query_start_loc_cpu\[1\]=3",
        ),
        (
            lambda m: _with(m, seq_lens=_set(m.seq_lens, 1, 5)),
            {},
            r"seq_lens\[1\]=5 differs from seq_lens_cpu\[1\]=4",
        ),
        (
            lambda m: _with(m, num_actual_tokens=5),
            {},
            r"num_actual_tokens=5 must equal query_start_loc_cpu\[-1\]=4",
        ),
        (
            lambda m: _with(m, slot_mapping=m.slot_mapping[:3]),
            {},
            "num_actual_tokens=4 exceeds the 3 rows of slot_mapping",
        ),
        (
            lambda m: _with(m, max_query_len=2),
            {},
            "max_query_len=2 is less than request 0's query length 3",
        ),
        (
            lambda m: _with(m, seq_lens=_set(m.seq_lens, 1, -1), seq_lens_cpu=_set(m.seq_lens_cpu, 1, -1)),
            {"causal": False},
            r"seq_lens_cpu\[1\]=-1 must be >= 0",
        ),
        (
            lambda m: _with(m, seq_lens=_set(m.seq_lens, 0, 2), seq_lens_cpu=_set(m.seq_lens_cpu, 0, 2)),
            {},
            r"seq_lens_cpu\[0\]=2 is less than request 0's query length 3",
        ),
        (
            lambda m: _with(m, num_computed_tokens_cpu=_set(m.num_computed_tokens_cpu, 1, 0)),
            {},
            r"num_computed_tokens_cpu\[1\]=0 must be seq_len - query_len = 3",
        ),
        (
            lambda m: _with(m, slot_mapping=_set(m.slot_mapping, 6, 0)),
            {},
            r"slot_mapping\[6\]=0 must be -1: rows past num_actual_tokens=4",
        ),
        (lambda m: m, {"num_blocks": 6}, "num_blocks=6 needs block_size"),
        (lambda m: m, {"block_size": 0}, "block_size=0 must be a positive integer"),
        (
            lambda m: m,
            {"block_size": 2},
            r"block_table_tensor has 2 pages per request; request 0 needs 3 "
            r"\(seq_len 6, block_size=2\)",
        ),
        (
            lambda m: _with(m, block_table_tensor=_set(m.block_table_tensor, (0, 1), 6)),
            {"num_blocks": 6, "block_size": 4},
            r"block_table_tensor\[0, 1\]=6 is outside \[0, num_blocks=6\)",
        ),
        (
            lambda m: _with(m, block_table_tensor=_set(m.block_table_tensor, (1, 0), -1)),
            {"num_blocks": 6, "block_size": 4},
            r"block_table_tensor\[1, 0\]=-1 is outside \[0, num_blocks=6\)",
        ),
        (
            lambda m: _with(m, slot_mapping=_set(m.slot_mapping, 2, 24)),
            {"num_blocks": 6, "block_size": 4},
            r"slot_mapping\[2\]=24 is outside \[-1, num_blocks \* block_size=24\)",
        ),
        (
            lambda m: _with(m, slot_mapping=_set(m.slot_mapping, 3, -2)),
            {"num_blocks": 6, "block_size": 4},
            r"slot_mapping\[3\]=-2 is outside \[-1",
        ),
    ],
)
def test_validate_errors(change, kwargs, match):
    md = valid_md()
    assert md.num_reqs == 2  # request bucket 2: no padding request
    with pytest.raises(ValueError, match=match):
        validate_common_metadata(change(md), **kwargs)


def test_validate_non_causal_allows_short_seq_lens():
    md = valid_md()
    seq = np.array([2, 4], np.int32)  # e.g. cross-attention over 2 encoder tokens
    validate_common_metadata(_with(md, seq_lens=seq, seq_lens_cpu=seq), causal=False)


def test_module_reads_env_only_in_get_kv_cache_layout():
    src = inspect.getsource(md_mod)
    assert src.count("os.environ") == 1
    assert "os.environ" in inspect.getsource(get_kv_cache_layout)


@settings(max_examples=30, deadline=None)
@given(
    a=st.lists(st.integers(0, 20), min_size=1, max_size=12).map(sorted),
    v=st.lists(st.integers(-2, 22), min_size=1, max_size=12),
    side=st.sampled_from(["left", "right"]),
)
def test_searchsorted_traced_equals_numpy(a, v, side):
    """The schedules' search, traced (every pair compared, no device loop) as NumPy's."""
    a, v = np.asarray(a, np.int32), np.asarray(v, np.int32)
    traced = jax.jit(lambda x, y: md_mod.searchsorted(jnp, x, y, side=side))(a, v)
    np.testing.assert_array_equal(np.asarray(traced), np.searchsorted(a, v, side=side))
