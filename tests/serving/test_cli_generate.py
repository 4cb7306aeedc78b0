"""``attn-stack generate``: a real run (JSON and text) and one-line errors for user mistakes."""

from __future__ import annotations

import json

import jax
import pytest

from attn_jax.cli import main

ARGS = ["generate", "--prompt", "The capital of France is", "--max-new-tokens", "6"]


def test_generate_json_matches_transformers(capsys, hf_smollm2):
    from tests.serving.hf_reference import hf_greedy

    prompt = "The capital of France is"
    assert main([*ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (result,) = out["results"]
    assert result["token_ids"] == hf_greedy(*hf_smollm2, prompt, 6)
    assert result["text"].startswith(" Paris") and result["finish_reason"] == "length"
    assert out["backend"] == "XLA" and out["backend_reason"] == "platform priority list for cpu"
    assert out["stats"]["compilations_after_warmup"] == 0
    assert out["stats"]["prefill_tokens_per_s"] > 0 and out["stats"]["decode_tokens_per_s"] > 0


def test_generate_text(capsys):
    """One new token: the prefill step alone (one compilation)."""
    assert main(["generate", "--prompt", "The capital of France is", "--max-new-tokens", "1", "--backend", "xla"]) == 0
    out = capsys.readouterr().out
    assert "attention backend: XLA (forced: global_force_attn_backend(XLA))" in out
    assert "--- 'The capital of France is' (5 prompt tokens, 1 new, length)\nThe capital of France is Paris" in out
    assert "prefill:" in out and "decode: n/a" in out and "0 after it" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "  "], "--prompt number 1 is empty: give some text to continue"),
        (["--devices", "0"], "devices=0 must be a positive integer"),
        (["--devices", "64"], f"devices=64 but only {len(jax.devices())} cpu device(s) are available"),
        (["--backend", "NOPE"], "Unknown attention backend: 'NOPE'. Valid options are: XLA, PALLAS_TPU"),
        (["--model", "/nonexistent/model.gguf"], "model file '/nonexistent/model.gguf' does not exist"),
        (["--temperature", "-1"], "temperature=-1.0 must be a number >= 0"),
        (["--max-new-tokens", "5000"], "--max-new-tokens 5000 leaves no room for a prompt: max_model_len=2048"),
    ],
    ids=["empty-prompt", "devices-0", "devices-too-many", "backend", "model-path", "temperature", "too-long"],
)
def test_user_errors_are_one_line_without_traceback(capsys, argv, message):
    prompt = [] if "--prompt" in argv else ["--prompt", "Hello"]
    assert main(["generate", *prompt, *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("attn-stack generate: error: ") and message in lines[-1], err
    assert "Traceback" not in err


def test_corrupt_model_file(tmp_path, capsys, smollm2_gguf):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(smollm2_gguf.read_bytes()[:4096])
    assert main(["generate", "--prompt", "Hi", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is a corrupt or truncated GGUF file" in err and "Traceback" not in err
