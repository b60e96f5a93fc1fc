"""Tests for speculant.text.tokenizer.

Model-free tests use tiny vocabularies built here (byte-level BPE, SentencePiece, a GGUF written with
gguf.GGUFWriter). Tests marked `real` load the default GGUF presets and check parity with transformers'
own GGUF tokenizer conversion (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from gguf_tokenizer import gguf_tokenizer

from speculant.errors import SpeculantError
from speculant.text.tokenizer import IncrementalDetokenizer, Tokenizer, read_gguf_metadata

TEXTS = [
    "Hello, world! How are you doing today?",
    "def foo(x):\n\tif x > 1:\n\t\treturn x ** 2\n    return None\n\n\n",
    "    indented = [1, 2, 3]  # comment\r\n\tclass A:  pass\n",
    "12345 and 3.14159 and 1,000,000 and 0x1F",
    "你好，世界！这是一个测试。",
    "emoji 😀👍🏽 and flags 🇫🇷 and family 👨‍👩‍👧",
    "café naïve résumé Ünïcödé façade",
    "mixed: αβγ Привет مرحبا こんにちは",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "  leading spaces and trailing   ",
    "don't won't I'm they've WE'LL",
    "",
    "\n\n\n",
]
MULTIBYTE = "naïve café → 😀👍🏽 你好，世界！日本語のテキスト 🇫🇷 ∑∫√ 한국어"
CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level vocabularies are spelled in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_fields(**extra: object) -> dict[str, object]:
    """A GGUF metadata mapping for a tiny byte-level BPE: 256 byte tokens, a few merges and control tokens."""
    spell = _bytes_to_unicode()
    tokens = [spell[b] for b in range(256)] + ["he", "ll", "hell", "hello", "Ġw", "<|im_start|>", "<|im_end|>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 261 + [3, 3],
            "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w"],
            "tokenizer.ggml.bos_token_id": 261, "tokenizer.ggml.eos_token_id": 262, **extra}


def _tiny(template: str | None = "{{ messages[0]['content'] }}") -> Tokenizer:
    return Tokenizer.from_gguf(_byte_fields(**({"tokenizer.chat_template": template} if template else {})))


# --------------------------------------------------------------------------------- model-free
def test_tiny_byte_level_roundtrip_and_specials() -> None:
    tok = _tiny()
    ids = tok.encode("hello world<|im_end|>")
    assert ids[:2] == [259, 260] and ids[-1] == 262  # "hello", "Ġw", ..., <|im_end|>
    assert tok.decode(ids) == "hello world<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "hello world"
    assert tok.bos_id == 261 and tok.eos_id == 262 and tok.eos_ids == frozenset({262})
    assert tok.add_bos is False and tok.vocab_size == 263
    assert tok.token_strings()[256:] == ["he", "ll", "hell", "hello", "Ġw", "<|im_start|>", "<|im_end|>"]


def test_add_bos_flag() -> None:
    tok = Tokenizer.from_gguf(_byte_fields(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.encode("hello") == [261, 259]
    assert tok.encode("hello", add_special=False) == [259]


def test_unknown_pre_tokenizer_and_model_are_user_errors() -> None:
    with pytest.raises(SpeculantError, match="'weird-pre'"):
        Tokenizer.from_gguf(_byte_fields(**{"tokenizer.ggml.pre": "weird-pre"}))
    with pytest.raises(SpeculantError, match="'bert'"):
        Tokenizer.from_gguf(_byte_fields(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(SpeculantError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2"})


def test_streaming_detokenizer_on_byte_tokens() -> None:
    tok = _tiny()
    ids = tok.encode(MULTIBYTE)  # one token per byte: every multi-byte character is split
    detok = tok.detokenizer()
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)
    assert detok.push(ids[MULTIBYTE.index("😀") + 0]) == ""  # leading byte of a 4-byte char is held...
    assert detok.flush() == "\ufffd"  # ...and flushed as a replacement character


def test_gguf_file_roundtrip(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    fields = _byte_fields(**{"tokenizer.chat_template": "{{ bos_token }}x"})
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(261)
    writer.add_eos_token_id(262)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{{ bos_token }}x")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = read_gguf_metadata(tmp_path / "t.gguf")
    for key, value in fields.items():
        assert meta[key] == value, key
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["general.architecture"] == "llama"
    assert Tokenizer.from_gguf(meta).apply_chat_template([]) == "<|im_start|>x"


def test_sentencepiece_matches_transformers_llama_tokenizer() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.tokenization_utils_base import generate_merges

    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor",
              "▁world", "▁t", "▁th", "▁the"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
              "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
              "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    tok = Tokenizer.from_gguf(fields)
    vocab = {t: i for i, t in enumerate(tokens)}
    ref = transformers.LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, dict(zip(tokens, scores))))
    assert tok.add_bos  # llama.cpp's default for SentencePiece vocabularies
    for text in ["hello world", "the world hello", "hello  wéird 😀 text", " leading", "hello</s>"]:
        assert tok.encode(text) == [1] + ref.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special=True).lstrip() == text.replace("</s>", "").lstrip()


def test_from_hf_dir(tmp_path: Path) -> None:
    tok = _tiny()
    tok._backend.save(str(tmp_path / "tokenizer.json"))  # noqa: SLF001 - build a folder from the tiny vocab
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
         "chat_template": "{{ eos_token }}{{ messages|length }}"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [262, 5]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_id, hf.eos_id, hf.eos_ids, hf.add_bos) == (261, 262, frozenset({262, 5}), True)
    assert hf.encode("hello world") == [261] + tok.encode("hello world")
    assert hf.token_strings() == tok.token_strings()
    assert hf.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_end|>1"
    with pytest.raises(SpeculantError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")


# --------------------------------------------------------------------------------- chat template sandbox
@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append(1) }}",
    "{{ range(10**9)|list }}",
    "{{ 1 / 0 }}",
])
def test_malicious_template_is_refused(template: str) -> None:
    with pytest.raises(SpeculantError, match="chat template"):
        _tiny(template).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers_match_transformers() -> None:
    msgs = [{"role": "user", "content": "<b>&'é"}]
    assert _tiny("{{ messages[0]|tojson }}").apply_chat_template(msgs) == '{"role": "user", "content": "<b>&\'é"}'
    assert _tiny("{{ messages|tojson(indent=2) }}").apply_chat_template(msgs) == json.dumps(msgs, indent=2, ensure_ascii=False)
    assert _tiny("{{ strftime_now('%Y') }}").apply_chat_template(msgs) == str(datetime.now().year)
    assert _tiny("{{ bos_token }}|{{ eos_token }}").apply_chat_template(msgs) == "<|im_start|>|<|im_end|>"
    assert _tiny("{% for m in messages %}\n  {% if 1 %}{{ m.role }}\n  {% endif %}\n{% endfor %}").apply_chat_template(msgs) == "user\n"
    assert _tiny("{% if add_generation_prompt %}G{% endif %}").apply_chat_template(msgs) == "G"
    assert _tiny("{% if add_generation_prompt %}G{% endif %}").apply_chat_template(msgs, add_generation_prompt=False) == ""
    assert _tiny("{% generation %}{{ messages|length }}{% endgeneration %}").apply_chat_template(msgs) == "1"
    assert _tiny("{% for m in messages %}{{ m.role }}{% break %}{% endfor %}").apply_chat_template(msgs * 2) == "user"
    with pytest.raises(SpeculantError, match="only user roles"):
        _tiny("{{ raise_exception('only user roles') }}").apply_chat_template(msgs)
    with pytest.raises(SpeculantError, match="chat template"):
        _tiny("{% if %}").apply_chat_template(msgs)


def test_no_chat_template() -> None:
    with pytest.raises(SpeculantError, match="no chat template"):
        _tiny(None).apply_chat_template([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------------- real models
def _model_path(preset: str) -> Path:
    from speculant.hub import resolve_model

    return resolve_model(preset)


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def pair(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, Any]:
    """(preset, our tokenizer, transformers' tokenizer) for a real GGUF model."""
    pytest.importorskip("transformers")
    path = _model_path(request.param)
    ours = Tokenizer.from_gguf(read_gguf_metadata(path))
    ref = gguf_tokenizer(path)  # transformers' own conversion of the GGUF, cached (tests/gguf_tokenizer.py)
    return request.param, ours, ref


@pytest.mark.real
def test_real_metadata(pair: tuple[str, Tokenizer, Any]) -> None:
    name, tok, ref = pair
    assert tok.add_bos is False and tok.chat_template
    assert tok.eos_id == ref.eos_token_id and tok.bos_id == ref.bos_token_id
    strings = tok.token_strings()
    assert tok.vocab_size == len(strings) == len(ref)
    im_end, endoftext = strings.index("<|im_end|>"), strings.index("<|endoftext|>")
    assert tok.eos_ids == frozenset({im_end, endoftext})


@pytest.mark.real
@pytest.mark.parametrize("text", TEXTS)
def test_real_encode_parity(pair: tuple[str, Tokenizer, Any], text: str) -> None:
    _, tok, ref = pair
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=True)
    assert tok.decode(ids) == ref.decode(ids) == text


@pytest.mark.real
def test_real_digits_split_individually(pair: tuple[str, Tokenizer, Any]) -> None:
    _, tok, _ = pair
    assert [tok.decode([i]) for i in tok.encode("x=12345")][-5:] == list("12345")


@pytest.mark.real
def test_real_chat_template_parity(pair: tuple[str, Tokenizer, Any]) -> None:
    _, tok, ref = pair
    for gen in (True, False):
        ours = tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen)
        assert ours == ref.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen)
    assert tok.encode(ours) == ref.encode(ours)


@pytest.mark.real
@pytest.mark.parametrize("skip_special", [False, True])
def test_real_streaming_equals_full_decode(pair: tuple[str, Tokenizer, Any], skip_special: bool) -> None:
    _, tok, _ = pair
    text = "<|im_start|>assistant\n" + MULTIBYTE + "\n" + TEXTS[1] + TEXTS[5] + "<|im_end|>"
    ids = tok.encode(text)
    detok = tok.detokenizer(skip_special=skip_special)
    assert isinstance(detok, IncrementalDetokenizer)
    pieces, windows = [], []
    for i in ids:
        pieces.append(detok.push(i))
        windows.append(len(detok._ids))  # noqa: SLF001 - the decode window must stay short (O(1) per token)
    assert max(windows) <= 8
    assert "".join(pieces) + detok.flush() == tok.decode(ids, skip_special=skip_special)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some emoji/CJK characters really do span tokens
    assert len(detok._ids) == 0  # noqa: SLF001 - the window was released after the flush


@pytest.mark.real
def test_real_qwen2_normalizes_to_nfc(pair: tuple[str, Tokenizer, Any]) -> None:
    """Qwen2's own tokenizer.json normalizes to NFC; transformers' GGUF conversion (and llama.cpp) do not.
    We follow the original tokenizer, so only decomposed text (rare in practice) encodes differently."""
    name, tok, ref = pair
    decomposed, composed = "Cafe\u0301 nai\u0308ve", "Café naïve"
    if name.startswith("qwen"):
        assert tok.encode(decomposed) == tok.encode(composed) == ref.encode(composed)
        assert tok.encode(decomposed) != ref.encode(decomposed)
    else:
        assert tok.encode(decomposed) == ref.encode(decomposed)


@pytest.mark.real
def test_real_from_hf_dir_matches_gguf(pair: tuple[str, Tokenizer, Any], tmp_path: Path) -> None:
    _, tok, ref = pair
    ref.save_pretrained(tmp_path)  # tokenizer.json + tokenizer_config.json + chat_template.jinja
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_id, hf.eos_id, hf.eos_ids, hf.add_bos) == (tok.bos_id, tok.eos_id, tok.eos_ids, tok.add_bos)
    assert hf.token_strings() == tok.token_strings()
    assert hf.apply_chat_template(CONVERSATION) == tok.apply_chat_template(CONVERSATION)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text), text
