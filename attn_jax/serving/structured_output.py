"""Structured outputs: the grammar state of guided requests (OpenAI's ``response_format``).

A request whose ``SamplingParams.json_schema`` is set (a JSON Schema as text; OpenAI's
``json_object`` is ``{"type": "object"}``) may only produce text the schema accepts. The
grammar engine is llguidance (the ``serve`` extra): its Rust core computes a request's
token mask in tens of microseconds from the parser state alone, with no per-vocabulary
precomputation at compile time, it takes JSON Schema, regular expressions and Lark
grammars, it has no torch dependency, and it is vLLM's ``guidance`` backend and
llama.cpp's. Its ``LLTokenizer`` is built once per engine from the ``tokenizers.Tokenizer``
the engine already has (``backend_tokenizer``: the GGUF's, no transformers needed).

Each guided request has a ``Guide``: an ``LLMatcher`` that consumes the request's tokens
as they are read back and its next-token mask, a bit per vocabulary entry,
i32[ceil(V / 32)] (bit ``t % 32`` of word ``t // 32`` set: token t allowed), which the
model runner keeps in a device table row the request owns (``ModelRunner.write_guide_rows``)
and applies before sampling (``sampling.apply_guides``). The grammar is complete when the
matcher stops (only EOS could follow): the request then ends with reason "stop".

JSON is generated compact (no whitespace between tokens: llguidance's
``whitespace_flexible`` off, which a schema's own ``x-guidance`` may turn on), so a model
cannot fill its tokens with whitespace that JSON allows.

Example::

    grammar = compile_json_schema('{"type": "object"}')       # ValueError names a bad schema
    guide = Guide(GuideTokenizer(tokenizer, vocab_size), grammar)
    guide.mask                                                 # i32[ceil(V / 32)]: the first token's
    finished = guide.advance(token)                            # True: the grammar is complete
"""

from __future__ import annotations

import json

import numpy as np

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""The schema of OpenAI's ``response_format`` ``{"type": "json_object"}``: any JSON object."""

_COMPACT = {"whitespace_flexible": False}


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError:
        raise ValueError("structured outputs (json_schema) need llguidance: pip install 'attn-stack[serve]'") from None
    return llguidance


def mask_words(vocab_size: int) -> int:
    """i32 words of one token mask: ceil(vocab_size / 32)."""
    return -(-vocab_size // 32)


def compile_json_schema(schema: str) -> str:
    """The llguidance grammar of a JSON Schema given as JSON text; ValueError with
    llguidance's own error when the text is not a JSON object or the schema does not
    compile (an unknown type, an unsupported keyword, a bad ``$ref``, ...)."""
    try:
        parsed = json.loads(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema={str(schema)[:80]!r} is not JSON text: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"json_schema={str(schema)[:80]!r} must be a JSON object (a JSON Schema)")
    llg = _llguidance()
    grammar = llg.LLMatcher.grammar_from_json_schema(parsed, defaults=_COMPACT)
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"json_schema does not compile: {error}")
    return grammar


class GuideTokenizer:
    """llguidance's ``LLTokenizer`` for an engine's tokenizer (anything with a
    ``backend_tokenizer``: ``GGUFTokenizer`` or a transformers fast tokenizer), over the
    model's ``vocab_size`` (a mask covers every logit). Building it takes about 0.4 s for a
    49,152-token vocabulary: an engine builds one, on its first guided request or in
    ``Engine.warmup``."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        llg = _llguidance()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"structured outputs need a tokenizer with a backend_tokenizer (tokenizers.Tokenizer); "
                f"{type(tokenizer).__name__} has none"
            )
        self.tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)
        self.vocab_size = vocab_size


class Guide:
    """One guided request's grammar state: its matcher and its next token's mask.

    ``mask`` i32[ceil(V / 32)] is the mask of the next token to sample (the first after
    construction); ``advance`` consumes a sampled token and computes the next mask.
    ``row`` is the device table row that holds ``mask`` (-1: not written since it changed
    or since the request took a new row), kept by the engine."""

    def __init__(self, tokenizer: GuideTokenizer, grammar: str) -> None:
        llg = _llguidance()
        self._matcher = llg.LLMatcher(tokenizer.tokenizer, grammar)
        self._fill_mask = llg.numpy.fill_next_token_bitmask
        self._masks = np.zeros((1, mask_words(tokenizer.vocab_size)), np.int32)
        self.mask = self._masks[0]
        self.row = -1
        self._fill()

    def _fill(self) -> None:
        self._check()
        self._fill_mask(self._matcher, self._masks, 0)
        self._check()
        self.row = -1

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ValueError(f"the output grammar failed: {self._matcher.get_error()}")

    def advance(self, token: int) -> bool:
        """Consumes ``token`` (one the mask allowed); True when the grammar is complete (the
        matcher stopped), else the next mask is computed. ValueError, naming llguidance's
        error, when the matcher fails (the request alone ends with reason "error")."""
        if not self._matcher.consume_token(int(token)):
            self._check()
            raise ValueError(f"token {token} was refused by the output grammar")
        if self._matcher.is_stopped():
            self._check()
            return True
        self._fill()
        return False
