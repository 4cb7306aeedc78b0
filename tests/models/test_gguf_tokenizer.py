"""The tokenizer built from the GGUF (gguf + tokenizers) against transformers' conversion of
the same file, its cache, and the main job's path staying free of torch and transformers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from attn_jax.models import gguf_loader
from attn_jax.models.gguf_loader import ModelLoadError, load_tokenizer, read_config, tokenizer_cache_dir
from attn_jax.models.gguf_tokenizer import GGUFTokenizer, TokenizerBuildError

CORPUS = [
    "The capital of France is",
    "Hello, world! How's it going? I'm fine; they'll see, we've won.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # x**2\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }  // C\n<div class='x'>&amp;</div>",
    "café ünïcödé naïve façade — “quotes” «guillemets» 日本語のテキスト 中文 한국어 Ελληνικά русский עברית",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖",
    "   leading and   multiple    spaces\n\n\n\ttabs\t\t  \r\n trailing   ",
    " ",
    "\n",
    "numbers 12345678 3.14159 1,000,000 -42 0x1F",
    "\u00a0non-breaking\u200bzero-width\u2028line-separator",
    "<|im_start|>user\nspecial tokens written in text<|im_end|>",
]
CHATS = [
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a colour 🎨"}],
    [{"role": "user", "content": "def f(x):\n    return x  # explain"}],
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def theirs(request):
    pytest.importorskip("torch", reason="transformers' GGUF conversion needs torch (the test extra)")
    return request.getfixturevalue("hf_smollm2_tokenizer")  # AutoTokenizer of the GGUF, once per session


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_ids_and_text_match_transformers(ours, theirs, text):
    ids = ours(text)["input_ids"]
    assert ids == theirs(text)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_decode_inverts_encode(ours, text):
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("messages", CHATS, ids=["system+user", "user"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, generation_prompt):
    text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    want = theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    assert ids == want["input_ids"]


def test_special_tokens_match_transformers(ours, theirs):
    assert ours.special_tokens_map == {k: v for k, v in theirs.special_tokens_map.items() if isinstance(v, str)}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs) == 49152
    assert ours.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"


def test_chat_prompt_text(ours):
    text = ours.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nName a colour 🎨<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = ours.apply_chat_template(CHATS[0], add_generation_prompt=True)
    assert ids[0] == ours.bos_token_id and ours.decode(ids) == text


def test_bad_inputs(ours):
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        ours.encode(b"hello")
    with pytest.raises(TypeError, match="messages must be a list of dicts"):
        ours.apply_chat_template("hello")


def _clear_caches():
    gguf_loader._load_tokenizer_cached.cache_clear()


def test_cache_is_written_then_read(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_STACK_CACHE_DIR", str(tmp_path / "empty"))
    _clear_caches()
    built = load_tokenizer(smollm2_gguf)
    folder = tokenizer_cache_dir(smollm2_gguf.resolve())
    assert (folder / "tokenizer.json").is_file() and (folder / "attn_stack_tokenizer.json").is_file()
    cached = GGUFTokenizer.load(folder)
    assert cached.encode(CORPUS[2]) == built.encode(CORPUS[2])
    assert cached.apply_chat_template(CHATS[0]) == built.apply_chat_template(CHATS[0])
    _clear_caches()


def test_unwritable_cache_still_works(smollm2_gguf, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("ATTN_STACK_CACHE_DIR", str(blocker))  # mkdir under a file fails, even as root
    _clear_caches()
    with caplog.at_level(logging.INFO, logger=gguf_loader.__name__):
        tokenizer = load_tokenizer(smollm2_gguf)
    assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert "cannot cache the tokenizer" in caplog.text
    _clear_caches()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong-format", "config-missing"])
def test_damaged_cache_is_rebuilt(smollm2_gguf, tmp_path, monkeypatch, caplog, damage):
    monkeypatch.setenv("ATTN_STACK_CACHE_DIR", str(tmp_path))
    _clear_caches()
    load_tokenizer(smollm2_gguf)
    folder = tokenizer_cache_dir(smollm2_gguf.resolve())
    tokenizer_json, config_json = folder / "tokenizer.json", folder / "attn_stack_tokenizer.json"
    if damage == "garbage":
        tokenizer_json.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        tokenizer_json.write_text(tokenizer_json.read_text()[:1000])
    elif damage == "wrong-format":
        config_json.write_text('{"format": 999}')
    else:
        config_json.unlink()
    _clear_caches()
    with caplog.at_level(logging.WARNING, logger=gguf_loader.__name__):
        tokenizer = load_tokenizer(smollm2_gguf)
    assert tokenizer.encode(CORPUS[1]) == GGUFTokenizer.from_gguf(gguf_loader._reader(smollm2_gguf)).encode(CORPUS[1])
    if damage != "config-missing":
        assert "is unreadable" in caplog.text and "rebuilding it from the GGUF" in caplog.text
    GGUFTokenizer.load(folder)  # repaired
    _clear_caches()


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


def _reader(**fields):
    class Reader:
        pass

    reader = Reader()
    reader.fields = {k.replace("__", "."): _Field(v) for k, v in fields.items()}
    reader.tensors = []
    return reader


def test_unsupported_vocabulary_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(TokenizerBuildError, match=r"tokenizer.ggml.model='llama' is not built without transformers"):
        GGUFTokenizer.from_gguf(_reader(tokenizer__ggml__model="llama"))
    with pytest.raises(TokenizerBuildError, match=r"GGUF metadata key 'tokenizer.ggml.merges' is missing"):
        GGUFTokenizer.from_gguf(_reader(tokenizer__ggml__model="gpt2", tokenizer__ggml__tokens=["a"]))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match=r"needs torch and transformers: pip install 'attn-stack\[torch\]'"):
        gguf_loader._transformers_tokenizer(tmp_path / "m.gguf", TokenizerBuildError("tokenizer.ggml.model='llama'"))


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.embedding_length", "llama.block_count"])
def test_zero_counts_name_the_key(key):
    fields = {
        "general.architecture": "llama",
        "llama.attention.head_count": 9,
        "llama.embedding_length": 576,
        "llama.feed_forward_length": 1536,
        "llama.block_count": 30,
        "llama.context_length": 8192,
        "llama.vocab_size": 49152,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    fields[key] = 0
    with pytest.raises(ModelLoadError, match=rf"GGUF metadata {key}=0 must be a positive integer"):
        read_config(_reader(**{k.replace(".", "__"): v for k, v in fields.items()}))


def test_main_job_imports_neither_torch_nor_transformers(tmp_path):
    """The main job's modules, the embedded model's weights and tokenizer, chat prompts included,
    with torch and transformers unimportable. (Running `generate` itself on the plain install,
    which has neither, is CI's first stage: `.ci/run`.)"""
    code = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['transformers'] = None\n"
        "import attn_jax.cli, attn_jax.serving\n"
        "from attn_jax.models.gguf_loader import load_gguf, load_tokenizer\n"
        "from attn_jax.models.smollm2 import gguf_path\n"
        "config, params = load_gguf(gguf_path())\n"
        "tok = load_tokenizer(gguf_path())\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'The capital of France is'}],\n"
        "                              add_generation_prompt=True, tokenize=True)\n"
        "print(repr(tok.decode(ids)))\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    env = os.environ | {"ATTN_STACK_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("ATTN_STACK_GGUF_WEIGHTS_CACHE", None)  # the file read and dequantised, as the main job does
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "The capital of France is" in result.stdout and "assistant" in result.stdout
    assert "transformers" not in result.stderr.lower() and "pytorch" not in result.stderr.lower()


def _write_llama3_style_gguf(path) -> None:
    """A tiny byte-level BPE GGUF as Llama 3 files are: "llama-bpe" split, BOS added, a user-defined token."""
    import gguf
    import numpy as np

    from attn_jax.models.gguf_tokenizer import _byte_spelling

    spell = _byte_spelling()
    tokens = ["<|begin_of_text|>", "<|end_of_text|>", "<think>"] + [spell[b] for b in range(256)]
    pairs = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("1", "2"), ("12", "3")]
    tokens += [a + b for a, b in pairs]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 4] + [1] * (len(tokens) - 3))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template(
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama3_style_file_matches_transformers(tmp_path):
    """A split regex, BOS added by __call__ but not twice in chat prompts, a user-defined token kept whole."""
    pytest.importorskip("torch", reason="transformers' GGUF conversion needs torch (the test extra)")
    from transformers import AutoTokenizer

    path = tmp_path / "llama3-style.gguf"
    _write_llama3_style_gguf(path)
    ours = GGUFTokenizer.from_gguf(gguf_loader._reader(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the cat in the hat 12345 <think>x</think>", "  héllo\n\n world 😀", "<|begin_of_text|>hi"]:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"] and ids[0] == ours.bos_token_id == 0
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "the 123"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=True)["input_ids"]
    assert ours.apply_chat_template(chat, tokenize=False) == "<|begin_of_text|><user>the 123<|end_of_text|>"
