"""Text <-> token ids, chat templates and streaming detokenization for one model.

Concept: a model's tokenizer is rebuilt as a `tokenizers.Tokenizer` either from the metadata a GGUF file
embeds (llama.cpp's `tokenizer.ggml.*` keys: vocabulary, merges, token types, special ids and the
pre-tokenizer name) or from a Hugging Face folder (`tokenizer.json` + `tokenizer_config.json`). On top
of it, `Tokenizer` knows the model's BOS policy, its stop tokens (`eos_ids`) and its chat template,
which is rendered as transformers renders it, in a locked-down sandbox (`text/chat_template.py`). Generated ids are
turned into text with an `IncrementalDetokenizer`, which decodes only a short window of recent
tokens and never emits half of a multi-byte character.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from speculant.text.chat_template import ChatTemplate
from speculant.errors import SpeculantError

# Pre-tokenizer split patterns, as in the models' own tokenizer.json files.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` names (llama.cpp) -> the pre-tokenizer family built by `_byte_level_bpe`.
_PRE_FAMILIES: Mapping[str, str] = MappingProxyType({
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "smollm": "smollm", "llama-bpe": "llama3", "llama3": "llama3",
    "llama-v3": "llama3", "smaug-bpe": "llama3", "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2"})
# Tokens that end a turn; stop generation when present in the vocabulary and flagged special/control.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
                "<|end|>", "<end_of_turn>")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time (prefix-offset / read-offset technique).

    `push` decodes only the tokens since the last emitted boundary plus the ones before it (needed for
    decoders whose output depends on context, e.g. SentencePiece's leading space), and holds text back
    while it ends in an incomplete UTF-8 sequence. `flush` returns whatever is still held back.
    """

    def __init__(self, backend: _Backend, *, skip_special: bool = False) -> None:
        self._backend = backend
        self._skip = skip_special
        self._ids: list[int] = []  # the window: already-emitted context tokens, then pending ones
        self._read = 0  # ids[:read] are emitted; their text is only context for what follows

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ('' while a character is unfinished)."""
        self._ids.append(int(token_id))
        done, text = self._decode(self._ids[:self._read]), self._decode(self._ids)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        del self._ids[:self._read]  # the next window starts at this (complete-character) boundary
        self._read = len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        """Return the held-back text (replacement characters for bytes that never completed) and reset."""
        done, text = self._decode(self._ids[:self._read]), self._decode(self._ids)
        self._ids, self._read = [], 0
        return text[len(done):] if text.startswith(done) else text


class Tokenizer:
    """A model's tokenizer: encode/decode, stop tokens, BOS policy and chat template."""

    def __init__(self, backend: _Backend, *, bos_id: int | None, eos_id: int | None,
                 eos_ids: frozenset[int] | None = None, add_bos: bool = False,
                 chat_template: str | None = None) -> None:
        self._backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = frozenset(eos_ids or ()) | ({eos_id} if eos_id is not None else set())
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template or None
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._template: ChatTemplate | None = None

    @classmethod
    def from_gguf(cls, fields: Mapping[str, object]) -> Tokenizer:
        """Build from decoded GGUF metadata (see `read_gguf_metadata`)."""
        kind = fields.get("tokenizer.ggml.model")
        tokens = fields.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise SpeculantError("this GGUF file has no tokenizer.ggml.tokens, so it embeds no tokenizer; "
                                 "use a GGUF converted with its tokenizer or the model's HF folder")
        if not all(isinstance(t, str) for t in tokens):
            raise SpeculantError("this GGUF's tokenizer.ggml.tokens is not a list of strings: the file is damaged")
        raw_types = fields.get("tokenizer.ggml.token_type")
        types = [t if isinstance(t, int) else 1 for t in raw_types] if isinstance(raw_types, list) else []
        types += [1] * (len(tokens) - len(types))  # missing types: normal tokens
        builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe, "gemma4": _gemma4_bpe}
        if kind not in builders:
            raise SpeculantError(f"tokenizer model {kind!r} in this GGUF is not supported; supported: "
                                 "'gpt2' (byte-level BPE), 'llama' (SentencePiece) and 'gemma4'. Use the HF folder "
                                 "instead")
        try:
            backend = builders[kind](fields, tokens)
            backend.add_tokens([AddedToken(t, special=False, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                        for t, ty in zip(tokens, types) if ty == _CONTROL])
        except SpeculantError:
            raise
        except BaseException as e:  # the tokenizers library's errors (and Rust panics, BaseExceptions)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise SpeculantError(f"this GGUF's tokenizer metadata is inconsistent ({type(e).__name__}: "
                                 f"{str(e)[:200]}): the file is damaged; download or convert it again") from None

        def token_id(key: str) -> int | None:
            value = fields.get(f"tokenizer.ggml.{key}")
            return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        stops = {i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
        index = {t: i for i, t in enumerate(tokens) if types[i] == _CONTROL}
        stops |= {index[t] for t in _END_OF_TURN if t in index}
        add_bos = fields.get("tokenizer.ggml.add_bos_token", kind == "llama")
        template = fields.get("tokenizer.chat_template")
        return cls(backend, bos_id=bos, eos_id=eos, eos_ids=frozenset(stops), add_bos=bool(add_bos),
                   chat_template=template if isinstance(template, str) else None)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from a Hugging Face model folder (tokenizer.json, tokenizer_config.json, generation_config.json)."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise SpeculantError(f"{folder} has no tokenizer.json; point at a Hugging Face model folder "
                                 "saved with a fast tokenizer, or use a GGUF file")
        try:
            backend = _Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises plain Exceptions for bad files
            raise SpeculantError(f"cannot read {folder / 'tokenizer.json'}: {str(e)[:200]}; the file is damaged "
                                 "or not a fast-tokenizer file: save the tokenizer again with transformers") from None
        config, generation = _read_json(folder / "tokenizer_config.json"), _read_json(folder / "generation_config.json")
        # transformers 4 also wrote the special tokens to special_tokens_map.json (some folders only there)
        special_map = _read_json(folder / "special_tokens_map.json")

        def special_id(name: str) -> int | None:
            token = config.get(name) if config.get(name) is not None else special_map.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos, eos = special_id("bos_token"), special_id("eos_token")
        if not (folder / "generation_config.json").is_file():
            # transformers generates with the model config's eos ids when there is no generation config
            generation = _read_json(folder / "config.json")
        gen_eos = generation.get("eos_token_id")
        gen_ids = [int(i) for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if isinstance(i, int)]
        eos = gen_ids[0] if eos is None and gen_ids else eos
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        stops = set(gen_ids) | {specials[t] for t in _END_OF_TURN if t in specials}
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # no flag: BOS is added iff the post-processor adds it
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, bos_id=bos, eos_id=eos, eos_ids=frozenset(stops), add_bos=bool(add_bos),
                   chat_template=template if isinstance(template, str) else None)

    @property
    def prompt_bos(self) -> int | None:
        """The BOS id that `encode` puts before a text, or None where the model takes none."""
        return self.bos_id if self.add_bos else None

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become those tokens. BOS only if the model asks."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens, BOS and EOS: chat templates delimit messages with them."""
        ids = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return frozenset(ids | self.eos_ids | ({self.bos_id} if self.bos_id is not None else set()))

    def token_strings(self) -> list[str]:
        """Raw vocabulary strings indexed by id ('' for unused ids)."""
        strings = [""] * self.vocab_size
        for token, index in self._backend.get_vocab(with_added_tokens=True).items():
            strings[index] = token
        return strings

    def detokenizer(self, *, skip_special: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._backend, skip_special=skip_special)

    def _token(self, index: int | None) -> str:
        return (self._backend.id_to_token(index) or "") if index is not None else ""

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's chat template (sandboxed Jinja, as transformers does)."""
        if self.chat_template is None:
            raise SpeculantError("this model has no chat template, so --chat cannot be used; "
                                 "pass a plain prompt instead or use a chat/instruct model")
        try:
            if self._template is None:
                self._template = ChatTemplate(self.chat_template)
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self._token(self.bos_id), eos_token=self._token(self.eos_id))
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                RecursionError) as e:
            raise SpeculantError(f"the model's chat template failed: {type(e).__name__}: {e}; "
                                 "check the messages (roles/content) or use a plain prompt") from e


# --------------------------------------------------------------------------------- builders
def _merges(fields: Mapping[str, object]) -> list[tuple[str, str]]:
    merges = fields.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise SpeculantError("this GGUF's byte-level BPE tokenizer has no tokenizer.ggml.merges; "
                             "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    pairs = [m.split(" ", 1) for m in merges if isinstance(m, str)]
    return [(p[0], p[1]) for p in pairs if len(p) == 2]


def _byte_level_bpe(fields: Mapping[str, object], tokens: list[str]) -> _Backend:
    pre = str(fields.get("tokenizer.ggml.pre", "default"))
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        raise SpeculantError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                             f"{', '.join(sorted(_PRE_FAMILIES))}); use the model's HF folder with tokenizer.json")
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    backend = _Backend(models.BPE(vocab, _merges(fields), ignore_merges=family == "llama3"))
    if family == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif family == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT if family == "qwen2" else _LLAMA3_SPLIT), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if family == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(fields: Mapping[str, object], tokens: list[str]) -> _Backend:
    """Llama-2 style SentencePiece BPE: merges derived from token scores, byte fallback, '▁' for spaces."""
    scores = fields.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise SpeculantError("tokenizer model 'llama' (SentencePiece) needs tokenizer.ggml.scores, which this "
                             "GGUF lacks; use the HF folder with tokenizer.json")
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    # Every split of a piece into two pieces is a merge, ranked by the merged piece's score
    # (ties: longer left, then longer right part first), which is how SentencePiece picks the next pair to join.
    candidates: list[tuple[float, int, int, int, str, str]] = []
    for index, (token, score) in enumerate(zip(tokens, scores)):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-float(score), -cut, cut - len(token), index, left, right))
    candidates.sort()
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    backend = _Backend(models.BPE(vocab, [(c[4], c[5]) for c in candidates], unk_token=unk_token,
                                  fuse_unk=True, byte_fallback=True))
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                     prepend_scheme="first" if prefix else "never")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _gemma4_bpe(fields: Mapping[str, object], tokens: list[str]) -> _Backend:
    """Gemma 4's BPE as llama.cpp runs it (llama-vocab.cpp, pre-type gemma4): spaces become '▁', the text splits
    only at newlines, and the merges run on the UTF-8 characters of each piece, with byte fallback."""
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    backend = _Backend(models.BPE(vocab, _merges(fields), unk_token=unk_token, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SpeculantError(f"cannot read {path}: {e}; fix or remove the file") from e
    return data if isinstance(data, dict) else {}


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, object]:
    """Decoded key -> value metadata of a GGUF file: strings, Python numbers/bools, lists for arrays."""
    from ..gguf_file import GGUFFile

    return GGUFFile(path).fields
