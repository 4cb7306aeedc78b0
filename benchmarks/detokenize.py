"""Host cost of a streamed token's text: microseconds per token at a given output length.

Compares re-decoding the whole output for every token (the engine before
``serving/detokenizer.py``) with ``IncrementalDetokenizer`` through its byte table (the
GGUF tokenizer's path: byte-level BPE), the ``tokenizers`` ``DecodeStream`` alone (the path
of other ``tokenizers`` backends, without the stop-string handling) and the detokenizer's
trailing-id window (any tokenizer with ``decode``). Then the byte table and ``DecodeStream``
again with ``--requests`` streams interleaved token by token, as an engine step feeds its
requests' detokenizers (each stream the text from its own offset). The target (issue 22):
the incremental cost is flat from token 10 to token 4,000. Runs on the CPU with the embedded SmolLM2's tokenizer.

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
    parser.add_argument("--requests", type=int, default=256, help="streams interleaved (default: 256)")
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
    from tokenizers.decoders import DecodeStream

    stream, backend = DecodeStream(skip_special_tokens=True), tokenizer.backend_tokenizer
    results["decode_stream"] = _per_token_us(lambda i: stream.step(backend, ids[i]), ids, at)
    for name, tok in (("byte_table", tokenizer), ("window", _DecodeOnly(tokenizer))):
        detok = IncrementalDetokenizer(tok)
        results[name] = _per_token_us(lambda i, d=detok: d.add(ids[i]), ids, at)
    for name, row in results.items():
        print(f"{name:>14}: " + ", ".join(f"token {a}: {us:.1f} us" for a, us in row.items()))
    interleaved = {}
    streams = [ids[r % 200 :][:128] for r in range(args.requests)]
    for name in ("byte_table", "decode_stream"):
        detoks = [IncrementalDetokenizer(tokenizer) for _ in streams]
        if name == "decode_stream":
            for d in detoks:  # the library's stream in place of the table
                d._bytes, d._texts, d._stream = None, None, DecodeStream(skip_special_tokens=True)
        start = time.perf_counter()
        for k in range(128):
            for d, s in zip(detoks, streams, strict=True):
                d.add(s[k])
        interleaved[name] = 1e6 * (time.perf_counter() - start) / (128 * len(streams))
        print(f"{name:>14}: {interleaved[name]:.2f} us a token, {args.requests} streams interleaved")
    write_json(
        output_path(args),
        {"tokens": len(ids), "us_per_token_at": results, f"us_per_token_{args.requests}_streams": interleaved},
    )


if __name__ == "__main__":
    main()
