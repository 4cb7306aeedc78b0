"""Host cost of a streamed token's text: microseconds per token at a given output length.

Compares re-decoding the whole output for every token (the engine before
``serving/detokenizer.py``) with ``IncrementalDetokenizer`` through the ``tokenizers``
``DecodeStream`` (the GGUF tokenizer's path) and through its trailing-id window (any
tokenizer with ``decode``). The target (issue 22): the incremental cost is flat from
token 10 to token 4,000. Runs on the CPU with the embedded SmolLM2's tokenizer.

    python benchmarks/detokenize.py [--tokens 4000] [--write]
"""

from __future__ import annotations

import argparse
import time

from results_io import add_output_args, output_path, write_json

TEXT = (
    "The quick brown fox jumps over the lazy dog. Überraschung: naïve café, 你好，世界 🎉. "
    "Numbers 3.14159 and code `x = f(y) + 1`; done.\n"
)


class _DecodeOnly:
    """The tokenizer through ``decode`` only: the detokenizer's window path."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def _per_token_us(step, ids: list[int], at: list[int], repeat: int = 50) -> dict[int, float]:
    """Mean microseconds per token of ``step(i)`` over the ``repeat`` tokens from position
    ``a``, for each ``a`` in ``at``; ``step`` is called for every token in order."""
    out, marks = {}, {a: a + repeat for a in at}
    start = None
    for i in range(len(ids)):
        if i in marks:
            start = (i, time.perf_counter())
        step(i)
        if start is not None and i + 1 == marks[start[0]]:
            out[start[0]] = 1e6 * (time.perf_counter() - start[1]) / repeat
            start = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4000, help="output length (default: 4000)")
    add_output_args(parser, "detokenize_cpu.json")
    args = parser.parse_args()

    from attn_jax.models.gguf_loader import load_tokenizer
    from attn_jax.models.smollm2 import gguf_path
    from attn_jax.serving.detokenizer import IncrementalDetokenizer

    tokenizer = load_tokenizer(gguf_path())
    ids = (tokenizer.encode(TEXT) * (args.tokens // 10 + 1))[: args.tokens + 60]
    at = [a for a in (10, 100, 1000, 2000, args.tokens - 60) if a + 50 <= len(ids)]
    results = {}

    text = ""

    def full(i):  # the old way: decode everything, emit the difference
        nonlocal text
        new = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        if not new.endswith("\ufffd"):
            text = new

    results["full_redecode"] = _per_token_us(full, ids, at)
    for name, tok in (("decode_stream", tokenizer), ("window", _DecodeOnly(tokenizer))):
        detok = IncrementalDetokenizer(tok)
        results[name] = _per_token_us(lambda i, d=detok: d.add(ids[i]), ids, at)
    for name, row in results.items():
        print(f"{name:>14}: " + ", ".join(f"token {a}: {us:.1f} us" for a, us in row.items()))
    write_json(output_path(args), {"tokens": len(ids), "us_per_token_at": results})


if __name__ == "__main__":
    main()
