"""A GGUF file's tokenizer, read with ``gguf`` and run by ``tokenizers``: no torch, no transformers.

A GGUF stores its tokenizer as metadata under llama.cpp's keys: the vocabulary
(``tokenizer.ggml.tokens``), the BPE merges, each token's type (3 = control, 4 =
user-defined), the special token ids, the pre-tokenizer's name (``tokenizer.ggml.pre``)
and the chat template (a jinja2 string). ``GGUFTokenizer.from_gguf`` rebuilds from these
the same ``tokenizers.Tokenizer`` that transformers' GGUF conversion builds (its
``byte_level_tokenizer`` and ``add_gguf_special_tokens`` for ``tokenizer.ggml.model =
"gpt2"``, byte-level BPE, as SmolLM2 and Llama 3 use), and renders chat prompts from the
template as transformers' ``apply_chat_template`` does (a sandboxed jinja2 environment
with ``trim_blocks`` and ``lstrip_blocks``). ``tests/models/test_gguf_tokenizer.py``
checks ids, text and chat prompts against transformers on a fixed corpus.

The class offers the part of a transformers tokenizer that ``attn_jax.serving.Engine``
uses::

    tok = GGUFTokenizer.from_gguf(path)
    tok("The capital of France is")["input_ids"]           # list[int]
    tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    tok.decode(ids, skip_special_tokens=True)
    tok.eos_token_id

SentencePiece (``"llama"``), unigram (``"t5"``) and other vocabularies are not built
here: ``attn_jax.models.gguf_loader.load_tokenizer`` hands those to transformers (the
``torch`` extra) or says which extra to install.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
from collections.abc import Mapping, Sequence

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)
"""``tokenizer.ggml.model`` values built here (byte-level BPE)."""

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: Mapping[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
"""``tokenizer.ggml.pre`` -> the split regex its merges were learned with (transformers'
``GGUF_PRE_TOKENIZER_SPLITS`` for these names). Any other name, SmolLM2's ``"smollm"``
included, gets GPT-2's byte-level split, as in transformers."""

_SPECIAL_NAMES = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
_CACHE_FORMAT = 1
_CONFIG_FILE = "attn_stack_tokenizer.json"
_TOKENIZER_FILE = "tokenizer.json"


class TokenizerBuildError(ValueError):
    """The GGUF's tokenizer metadata cannot be built here (unsupported model, missing key)."""


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _field(reader, key: str, required: bool = True):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise TokenizerBuildError(f"GGUF metadata key {key!r} is missing: the file has no usable tokenizer")
        return None
    return field.contents()


class GGUFTokenizer:
    """Byte-level BPE tokenizer with a GGUF's special tokens and chat template.

    Args:
      tokenizer: the ``tokenizers.Tokenizer`` (BPE model, pre-tokenizer, decoder, added tokens).
      special_ids: ``{"bos": id, "eos": id, "unk": id, "pad": id}``; absent or None when
        the file names none.
      chat_template: the jinja2 chat template, or None.
      add_bos_token / add_eos_token: whether ``__call__`` adds BOS / EOS (the file's
        ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``; default False).
    """

    def __init__(
        self,
        tokenizer,
        special_ids: Mapping[str, int | None],
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ) -> None:
        from tokenizers import processors

        self._tokenizer = tokenizer
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        unknown = set(special_ids) - set(_SPECIAL_NAMES)
        if unknown:
            raise ValueError(f"special_ids has unknown keys {sorted(unknown)}; valid: {list(_SPECIAL_NAMES)}")
        for name, token_id in special_ids.items():
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise ValueError(f"{name}_token_id={token_id} is outside the vocabulary [0, {vocab_size})")
        self._special_ids = {name: special_ids.get(name) for name in _SPECIAL_NAMES}
        self.chat_template = chat_template
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        bos, eos = (self._token(n) if add else None for n, add in (("bos", add_bos_token), ("eos", add_eos_token)))
        single = [f"{bos}:0"] * (bos is not None) + ["$A:0"] + [f"{eos}:0"] * (eos is not None)
        specials = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t is not None]
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, reader) -> GGUFTokenizer:
        """Builds the tokenizer from a ``gguf.GGUFReader``'s metadata.

        Raises ``TokenizerBuildError`` (a ValueError) naming the key or value when the file's
        tokenizer is not byte-level BPE or a key is missing."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        model = _field(reader, "tokenizer.ggml.model")
        if model not in SUPPORTED_TOKENIZER_MODELS:
            raise TokenizerBuildError(
                f"tokenizer.ggml.model={model!r} is not built without transformers; built here: "
                f"{list(SUPPORTED_TOKENIZER_MODELS)}"
            )
        tokens = _field(reader, "tokenizer.ggml.tokens")
        merges = _field(reader, "tokenizer.ggml.merges")
        types = _field(reader, "tokenizer.ggml.token_type", required=False) or [1] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerBuildError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens: the file is inconsistent"
            )
        spelling = _byte_spelling()
        alphabet = set(spelling.values())

        def spelled(token: str) -> str:  # a token written with other characters is respelled byte by byte
            return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

        vocab = {spelled(token): index for index, token in enumerate(tokens)}
        pairs = []
        for i, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2:
                raise TokenizerBuildError(f"tokenizer.ggml.merges[{i}]={merge!r} is not two tokens split by a space")
            pairs.append((parts[0], parts[1]))
        tokenizer = Tokenizer(
            BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="")
        )
        split = PRE_TOKENIZER_SPLITS.get(_field(reader, "tokenizer.ggml.pre", required=False))
        if split is None:
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(False, use_regex=False),
                ]
            )
        tokenizer.decoder = decoders.ByteLevel()
        # Control tokens stay whole and count as special (skipped by decode(skip_special_tokens=True));
        # one spelled outside the byte alphabet is a llama.cpp mislabel and is left out, as transformers does.
        control = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL and set(t) <= alphabet]
        tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        user = [t for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED and t in vocab]
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        special_ids = {}
        for name, key in _SPECIAL_NAMES.items():
            value = _field(reader, f"tokenizer.ggml.{key}", required=False)
            special_ids[name] = None if value is None else int(value)
        return cls(
            tokenizer,
            special_ids,
            chat_template=_field(reader, "tokenizer.chat_template", required=False),
            add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", required=False)),
            add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", required=False)),
        )

    def save(self, folder: str | os.PathLike) -> None:
        """Writes ``tokenizer.json`` and this class's settings into ``folder`` (created);
        each file is written whole or not at all (a temporary file, then renamed)."""
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {
            "format": _CACHE_FORMAT,
            "special_ids": self._special_ids,
            "chat_template": self.chat_template,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
        }
        for name, text in ((_TOKENIZER_FILE, self._tokenizer.to_str()), (_CONFIG_FILE, json.dumps(config))):
            tmp = folder / f".{name}.{os.getpid()}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, folder / name)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> GGUFTokenizer:
        """Reads what ``save`` wrote. Raises ValueError (or OSError) for a missing or damaged folder."""
        from tokenizers import Tokenizer

        folder = pathlib.Path(folder)
        config = json.loads((folder / _CONFIG_FILE).read_text(encoding="utf-8"))
        if not isinstance(config, dict) or config.get("format") != _CACHE_FORMAT:
            raise ValueError(f"{folder / _CONFIG_FILE} is not format {_CACHE_FORMAT}")
        try:
            tokenizer = Tokenizer.from_file(str(folder / _TOKENIZER_FILE))
        except Exception as e:  # tokenizers raises its own Exception type for a bad file
            raise ValueError(f"{folder / _TOKENIZER_FILE} is unreadable: {e}") from e
        return cls(
            tokenizer,
            config["special_ids"],
            chat_template=config["chat_template"],
            add_bos_token=config["add_bos_token"],
            add_eos_token=config["add_eos_token"],
        )

    # ------------------------------------------------------------------ special tokens

    def _token(self, name: str) -> str | None:
        token_id = self._special_ids[name]
        return None if token_id is None else self._tokenizer.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_ids["bos"]

    @property
    def eos_token_id(self) -> int | None:
        return self._special_ids["eos"]

    @property
    def unk_token_id(self) -> int | None:
        return self._special_ids["unk"]

    @property
    def pad_token_id(self) -> int | None:
        return self._special_ids["pad"]

    @property
    def bos_token(self) -> str | None:
        return self._token("bos")

    @property
    def eos_token(self) -> str | None:
        return self._token("eos")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """``{"bos_token": "<|im_start|>", ...}`` for the special tokens the file names."""
        return {f"{name}_token": self._token(name) for name in _SPECIAL_NAMES if self._special_ids[name] is not None}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` that encodes and decodes (transformers' fast tokenizers'
        name); the engine streams text through it (``serving/detokenizer.py``)."""
        return self._tokenizer

    def __repr__(self) -> str:
        specials = ", ".join(f"{k}={v!r}" for k, v in self.special_tokens_map.items())
        return f"GGUFTokenizer(vocab_size={self.vocab_size}, {specials})"

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with BOS/EOS when the file asks for them and
        ``add_special_tokens``). Special tokens written in the text stay whole."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}: {text!r:.80}")
        # ``encode_batch`` releases the GIL while it works (``encode`` holds it: a 128 KiB prompt
        # stalled every other thread 93 ms), so a server's encoder thread runs beside its engine.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``{"input_ids": ids, "attention_mask": ones}``, as a transformers tokenizer returns for one text."""
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; an incomplete UTF-8 sequence at the end decodes to U+FFFD."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs,
    ) -> list[int] | str:
        """Renders ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the file's
        chat template; returns the prompt's token ids (no BOS/EOS added beyond what the
        template writes) or, with ``tokenize=False``, its text. Extra keyword arguments
        reach the template (as in transformers)."""
        if self.chat_template is None:
            raise ValueError("this GGUF has no tokenizer.chat_template: encode the prompt as plain text instead")
        if isinstance(messages, str | bytes) or not all(isinstance(m, Mapping) for m in messages):
            raise TypeError(
                f"messages must be a list of dicts like {{'role': 'user', 'content': '...'}}: {messages!r:.80}"
            )
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = _compiled_template(self.chat_template).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled as transformers compiles it: sandboxed, ``trim_blocks`` and
    ``lstrip_blocks``, the loop-control extension, ``tojson`` without HTML escaping,
    ``raise_exception`` and ``strftime_now``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)
