"""transformers' tokenizer for a GGUF file, converted once and kept on disk.

`AutoTokenizer.from_pretrained(dir, gguf_file=...)` rebuilds a 151K-token BPE from the GGUF's metadata in
Python (~14 s of CPU for Qwen2.5), and several test modules need that tokenizer. Its `save_pretrained` form
loads in about a second, so the conversion is saved under $SPECULANT_HOME/test-tokenizers, keyed by the file
(path, size, mtime) and the transformers and tokenizers versions: a changed file or library converts again.

A reload is not always the same tokenizer: transformers' Qwen2Tokenizer adds an NFC normalizer when it loads
a tokenizer.json, which the GGUF conversion has not. So the converted backend is kept verbatim too, its
pipeline (normalizer, pre-tokenizer, post-processor, decoder) is put back on load, and a reload whose backend,
special tokens or chat template differ from the conversion's is not used: the file is converted again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

PIPELINE = ("normalizer", "pre_tokenizer", "post_processor", "decoder")


def _facts(tok: Any) -> str:
    """What must survive the round trip, besides the backend: as one comparable string."""
    return json.dumps([type(tok).__name__, len(tok), tok.special_tokens_map, tok.chat_template,
                       tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.clean_up_tokenization_spaces,
                       getattr(tok, "add_bos_token", None), getattr(tok, "add_eos_token", None)], sort_keys=True)


def _reload(folder: Path) -> Any | None:
    """The tokenizer saved in `folder`, or None where it does not reload as the conversion was."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    backend = (folder / "backend.json").read_text()
    tok = AutoTokenizer.from_pretrained(str(folder))
    want = Tokenizer.from_str(backend)
    for part in PIPELINE:
        setattr(tok.backend_tokenizer, part, getattr(want, part))
    same = tok.backend_tokenizer.to_str() == backend and _facts(tok) == (folder / "facts.json").read_text()
    return tok if same else None


def gguf_tokenizer(path: Path) -> Any:
    """AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), from the cache where it was converted."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    from speculant.hub import speculant_home

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{tokenizers.__version__}"
    root = speculant_home() / "test-tokenizers"
    folder = root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if folder.is_dir() and (tok := _reload(folder)) is not None:
        return tok
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
        tok.save_pretrained(str(tmp))
        (tmp / "backend.json").write_text(tok.backend_tokenizer.to_str())
        (tmp / "facts.json").write_text(_facts(tok))
        if _reload(tmp) is not None:
            shutil.rmtree(folder, ignore_errors=True)  # a stale entry that did not reload
            os.replace(tmp, folder)  # atomic; a concurrent process's identical entry may already be there
    except OSError:
        pass  # an unwritable home: the converted tokenizer still serves this process
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok
