"""The engine core's checks of a submission whose prompt is token ids (what a server's
``/v1/completions`` hands it): the ids pass as given; a refusal is a ``RequestError`` naming
the field and the bad value, and no token id is converted behind the client's back."""

from __future__ import annotations

import pytest

from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.server.engine_core import EngineCore, GenerationSpec, RequestError
from attn_jax.serving import Engine

CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    eos_token_ids=(1,),
)  # fmt: skip


@pytest.fixture(scope="module")
def core() -> EngineCore:
    engine = Engine(LlamaModel(CONFIG, block_size=4), init_params(CONFIG, seed=0), max_num_seqs=2,
                    max_num_batched_tokens=16, max_model_len=32)  # fmt: skip
    return EngineCore(engine, lambda timeout: [], lambda message: None)


def test_token_ids_pass_as_given(core):
    ids, params, echo = core._prepare(GenerationSpec(prompt=[3, 4, 5], max_tokens=4))
    assert ids == [3, 4, 5] and params.max_new_tokens == 4 and echo is None


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([3, 1.5], r"prompt could not be encoded: prompt token 1 is 1\.5 \(float\): token ids must be integers"),
        ([True, 3], r"prompt token 0 is True \(bool\)"),
        ([3, 64], r"prompt holds token id 64, outside the vocabulary \[0, 64\)"),
    ],
)
def test_a_bad_token_id_is_refused_by_name(core, prompt, match):
    with pytest.raises(RequestError, match=match) as info:
        core._prepare(GenerationSpec(prompt=prompt, max_tokens=4))
    assert info.value.param == "prompt"
