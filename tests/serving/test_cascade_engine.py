"""Cascade attention driven by the engine: the common prefix of the running requests (pages
every one of them holds, capped at the step's smallest computed length), the builder's
decision with its thresholds, the same greedy tokens as with prefix caching off, the steps
counted, and a new prefix length compiling nothing."""

from __future__ import annotations

import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.serving import BlockAllocator, CascadeConfig, Engine, Request, SamplingParams, Scheduler
from attn_jax.serving.cascade import common_prefix_len, num_common_prefix_blocks

CONFIG = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    eos_token_ids=(1,), max_position_embeddings=256,
)  # fmt: skip
PARAMS = init_params(CONFIG, seed=3)
PAGE = 16
FORCED = CascadeConfig(min_prefix_len=PAGE, min_requests=2)
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _prompts(prefix_len: int, total: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``total`` tokens sharing their first ``prefix_len``."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 128, prefix_len).tolist()
    return [prefix + rng.integers(2, 128, total - prefix_len).tolist() for _ in range(n)]


def _engine(caching: bool, cascade, num_scheduler_steps: int = 4) -> Engine:
    return Engine(
        LlamaModel(CONFIG, block_size=PAGE), PARAMS, enable_prefix_caching=caching, cascade_attention=cascade,
        max_num_seqs=8, max_num_batched_tokens=128, max_model_len=96, buckets=MetadataBuckets((128,), (8,), (6,)),
        num_scheduler_steps=num_scheduler_steps,
    )  # fmt: skip


# ---------------------------------------------------------------- the common prefix, on the host


def _request(name: str, ids: list[int]) -> Request:
    return Request(name, ids, GREEDY, seed=0)


def _computed(scheduler: Scheduler, batch) -> None:
    """What the engine does after dispatching ``batch``: its tokens computed, one sampled (pending)."""
    for request, n in zip(batch.requests, batch.num_new, strict=True):
        request.num_computed += n
        request.num_pending += int(request.num_computed == request.num_tokens)


def test_common_prefix_blocks_follow_admission_abort_and_preemption():
    bs = 4
    scheduler = Scheduler(BlockAllocator(64), bs, 8, 64, enable_prefix_caching=True)
    shared = list(range(2, 14))  # 12 tokens: 3 full blocks
    a = _request("a", [*shared, 50])
    scheduler.add(a)
    _computed(scheduler, scheduler.schedule())
    assert scheduler.num_common_prefix_blocks() == 4  # one request holds all its pages (capped later)
    b, c = _request("b", [*shared, 60, 61]), _request("c", [*shared, 70])
    for r in (b, c):
        scheduler.add(r)
    batch = scheduler.schedule()  # a decodes; b and c take the 3 cached blocks
    assert [r.num_cached_tokens for r in (b, c)] == [12, 12]
    assert scheduler.num_common_prefix_blocks() == 3
    assert common_prefix_len(3, bs, [r.num_computed for r in batch.requests]) == 12
    _computed(scheduler, batch)

    d = _request("d", [*shared[:4], 90, 91, 92, 93, 94])  # shares only the first block
    scheduler.add(d)
    batch = scheduler.schedule()
    assert d.num_cached_tokens == 4 and scheduler.num_common_prefix_blocks() == 1
    assert common_prefix_len(1, bs, [r.num_computed for r in batch.requests]) == 4
    _computed(scheduler, batch)

    scheduler.finish(d, "abort")  # its reference to the first block is dropped
    assert scheduler.num_common_prefix_blocks() == 3
    scheduler._preempt(c)  # what a full pool does to the newest request
    assert c.blocks == [] and scheduler.num_common_prefix_blocks() == 3  # a and b still share 3 blocks
    scheduler.finish(a, "stop")
    assert scheduler.num_common_prefix_blocks() == len(b.blocks)  # b alone
    scheduler.finish(b, "stop")
    assert scheduler.num_common_prefix_blocks() == 0 and num_common_prefix_blocks(scheduler.allocator, []) == 0


def test_common_prefix_len_caps_at_the_least_computed_and_aligns_to_pages():
    assert common_prefix_len(4, 16, [70, 90]) == 64
    assert common_prefix_len(4, 16, [70, 50]) == 48  # 50 computed tokens: 3 whole pages
    assert common_prefix_len(4, 16, [70, 0]) == 0  # a request with nothing cached yet
    assert common_prefix_len(0, 16, [70, 90]) == 0
    assert common_prefix_len(4, 16, []) == 0


def test_the_builder_decides_with_its_thresholds_or_the_given_ones():
    group = LlamaModel(CONFIG, block_size=PAGE).attention_group
    eight = np.ones(8, np.int32)
    assert group.cascade_prefix_len(256, eight) == 256  # vLLM's thresholds: >= 256 tokens, >= 8 requests
    assert group.cascade_prefix_len(240, eight) == 0
    assert group.cascade_prefix_len(256, eight[:7]) == 0
    assert group.cascade_prefix_len(64, eight[:2], min_prefix_len=16, min_requests=2) == 64
    assert group.cascade_prefix_len(0, eight, min_prefix_len=16, min_requests=2) == 0
    with pytest.raises(ValueError, match="min_requests=0"):
        CascadeConfig(min_requests=0)
    with pytest.raises(TypeError, match="cascade_attention='yes' must be a bool or a CascadeConfig"):
        CascadeConfig.of("yes")


def test_the_runner_gives_the_builder_each_requests_keys_and_the_model_switch():
    """PALLAS_GPU's float32 rule weighs each request's keys (the runner passes the step's
    ``seq_lens``); ``CascadeConfig(performance_model=False)`` leaves its model out."""
    from attn_jax.registry import AttentionBackendEnum

    config = LlamaConfig(
        vocab_size=128, hidden_size=576, intermediate_size=64, num_layers=1, num_heads=9, num_kv_heads=3,
        head_dim=64, eos_token_ids=(1,), max_position_embeddings=2048,
    )  # fmt: skip
    model = LlamaModel(config, block_size=PAGE, attn_backend=AttentionBackendEnum.PALLAS_GPU.get_class())
    group = model.attention_group
    group.metadata_builder.device_kind = "NVIDIA H100 80GB HBM3"
    sixteen = np.ones(16, np.int32)
    assert group.cascade_prefix_len(1024, sixteen, seq_lens=np.full(16, 1057)) == 1024
    assert group.cascade_prefix_len(1024, sixteen, seq_lens=np.full(16, 1500)) == 0  # own tokens outgrow the prefix
    assert group.cascade_prefix_len(1024, sixteen, seq_lens=np.full(16, 1500), performance_model=False) == 1024
    assert CascadeConfig().performance_model and not CascadeConfig(performance_model=False).performance_model


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def uncached_tokens():
    engine = _engine(caching=False, cascade=False, num_scheduler_steps=1)  # one compiled variant fewer
    return [c.output_ids for c in engine.generate(_prompts(64, 72), GREEDY)]


@pytest.fixture(scope="module")
def cascade_engine():
    return _engine(caching=True, cascade=FORCED)


def test_greedy_tokens_identical_with_cascade_and_with_caching_off(uncached_tokens, cascade_engine):
    engine = cascade_engine
    first = len(engine.stats)
    before = engine.totals
    assert [c.output_ids for c in engine.generate(_prompts(64, 72), GREEDY)] == uncached_tokens
    steps = engine.stats[first:]
    # The first step computes one prompt (the others wait for its blocks); every later call of
    # decodes only runs cascade over the 64 shared tokens (4 pages), multi-step calls included;
    # calls with a prefill do not (a cascade structure for them would double their programs).
    assert steps[0].cascade_prefix_len == 0
    assert [s.cascade_prefix_len for s in steps[1:]] == [0 if s.num_prefill_tokens else 64 for s in steps[1:]]
    assert any(s.num_steps > 1 for s in steps[1:]) and any(s.num_prefill_tokens for s in steps[1:])
    assert (engine.totals - before).cascade_steps == sum(not s.num_prefill_tokens for s in steps[1:]) > 0


def test_a_new_prefix_length_compiles_nothing_and_cascade_can_be_turned_off(cascade_engine):
    engine = cascade_engine
    engine.generate(_prompts(64, 72, seed=1), GREEDY)  # every bucket of this workload compiled
    compilations = engine.num_compilations
    first = len(engine.stats)
    engine.generate(_prompts(48, 72, seed=2), GREEDY)  # the same shapes, 3 pages shared
    assert engine.num_compilations == compilations
    assert {s.cascade_prefix_len for s in engine.stats[first:]} == {0, 48}
    engine.cascade_attention = False
    first = len(engine.stats)
    engine.generate(_prompts(64, 72, seed=3), GREEDY)
    assert all(s.cascade_prefix_len == 0 for s in engine.stats[first:])
    assert engine.cascade_attention == CascadeConfig(enabled=False)
    engine.cascade_attention = FORCED


def test_prefix_caching_switches_only_while_idle(cascade_engine, uncached_tokens):
    engine = cascade_engine
    engine.enable_prefix_caching = False
    first = len(engine.stats)
    assert [c.output_ids for c in engine.generate(_prompts(64, 72), GREEDY)] == uncached_tokens
    assert sum(s.num_cached_tokens for s in engine.stats[first:]) == 0
    engine.add_request(_prompts(64, 72)[0], GREEDY)
    with pytest.raises(ValueError, match="enable_prefix_caching can change only while no request is live"):
        engine.enable_prefix_caching = True
    for _ in engine.stream():
        pass
    engine.enable_prefix_caching = True
    assert engine.enable_prefix_caching and all(s.enable_prefix_caching for s in engine.schedulers)


@pytest.mark.gpu
def test_cascade_compiled_on_a_gpu_gives_the_uncached_tokens():
    """PALLAS_GPU compiled: 8 requests sharing 1024 tokens, cascade by the builder's own
    rule (its thresholds; float32, so its model of the dot work too, which takes cascade at
    this shape: the prefix part's 16-row q-blocks, its KV range split 8 ways in the decodes),
    the same greedy tokens as with caching off."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from attn_jax.registry import AttentionBackendEnum

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
        head_dim=64, max_position_embeddings=2048,
    )  # fmt: skip
    params = init_params(config, seed=5)
    prompts = _prompts(1024, 1040, n=8, seed=4)
    backend = AttentionBackendEnum.PALLAS_GPU.get_class()

    def run(caching: bool):
        engine = Engine(
            LlamaModel(config, block_size=PAGE, attn_backend=backend), params, enable_prefix_caching=caching,
            cascade_attention=caching, max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=1056,
            num_scheduler_steps=4,
        )  # fmt: skip
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        return [c.output_ids for c in outputs], engine

    reference, _ = run(False)
    tokens, engine = run(True)
    assert tokens == reference
    assert engine.totals.cascade_steps > 0 and {s.cascade_prefix_len for s in engine.stats} == {0, 1024}
