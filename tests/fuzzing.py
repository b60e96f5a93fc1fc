"""Fuzzing harness: damaged GGUF headers and HF json files (config.json's in fuzzing_hf_config.py), each
case run in a watched worker process.

Seeds come from the real cached GGUF files: their first 8 MB are parsed, the tokenizer arrays cut to
the first `VOCAB` entries (merges to those among them), and the header written back out; the file is
then extended, sparse, to the real file's size so that its tensor directory still fits and an
undamaged case loads. Case i is a pure function of i (its seed file and its random mutations), so a
failure is replayed with `replay(target, i)`.

Workers run cases and report each outcome over a pipe. The parent gives every case `CASE_SECONDS`:
a case that takes longer is a hang (the worker is killed), a worker that dies is a crash, and any
exception other than SpeculantError is a bug. Workers run under an address-space limit, so an
unbounded allocation is a MemoryError, also a bug.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import resource
import struct
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from fuzzing_hf_config import config_seeds, config_target, mutate_tree
from gguf import GGUFValueType as T

CASE_SECONDS = 20.0  # a case takes ~10-50 ms; 20 s means stuck, even on a loaded machine
HEADER_BYTES = 8 << 20
VOCAB = 400
MODELS = Path(os.environ.get("SPECULANT_HOME", Path.home() / ".cache" / "speculant")) / "models"
HUGE = (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**64 - 1)
_SCALAR = {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
           T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d"}


# ------------------------------------------------------------------------------------------- seeds
@dataclass
class Seed:
    name: str
    size: int  # the real file's size: the case file is extended to it
    kvs: list[list]  # [key, vtype, etype, value]
    tensors: list[list]  # [name, dims, ttype, offset]


def seed_files() -> list[Path]:
    return sorted(MODELS.glob("*.gguf"))


def load_seeds() -> list[Seed]:
    from speculant.gguf_file import _parse

    seeds = []
    for path in seed_files():
        with path.open("rb") as f:
            head = f.read(HEADER_BYTES)
        size = path.stat().st_size
        fields, types, tensors = _parse(memoryview(head), size)
        tokens = fields.get("tokenizer.ggml.tokens", [])[:VOCAB]
        vocab = set(tokens)
        kvs = []
        for key, value in fields.items():
            vtype, etype = types[key]
            if key == "tokenizer.ggml.merges":
                value = [m for m in value if len(p := m.split(" ")) == 2 and p[0] in vocab and p[1] in vocab
                         and p[0] + p[1] in vocab]
            elif key.startswith("tokenizer.ggml.") and isinstance(value, list) and len(value) > VOCAB:
                value = value[:VOCAB]
            kvs.append([key, vtype, etype, value])
        base = min(t.data_offset for t in tensors)
        seeds.append(Seed(path.name, size, kvs, [[t.name, t.shape, int(t.tensor_type), t.data_offset - base]
                                                 for t in tensors]))
    return seeds


# -------------------------------------------------------------------------------------- serializer
@dataclass
class Header:
    data: bytearray = field(default_factory=bytearray)
    u64s: list[int] = field(default_factory=list)  # offsets of counts, lengths, dims, tensor offsets
    u32s: list[int] = field(default_factory=list)  # offsets of value types, n_dims, tensor types

    def u32(self, v: int, mark: bool = True) -> None:
        if mark:
            self.u32s.append(len(self.data))
        self.data += struct.pack("<I", v & 0xFFFFFFFF)

    def u64(self, v: int) -> None:
        self.u64s.append(len(self.data))
        self.data += struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)

    def string(self, s: str) -> None:
        b = s.encode("utf-8", "surrogatepass")
        self.u64(len(b))
        self.data += b

    def value(self, vtype: int, etype: int | None, v: object) -> None:
        if vtype == T.STRING:
            self.string(str(v))
        elif vtype == T.ARRAY:
            items = list(v) if isinstance(v, (list, tuple)) else [v]
            self.u32(etype)
            self.u64(len(items))
            if etype in _SCALAR:
                self.data += np.array(items).astype(np.dtype(_SCALAR[etype].replace("<?", "?")), copy=False).tobytes()
            else:
                for item in items:
                    self.value(etype, T.UINT8, item)
        else:
            self.data += struct.pack(_SCALAR[T(vtype)], v)


def serialize(seed: Seed) -> Header:
    h = Header()
    h.data += b"GGUF"
    h.u32(3, mark=False)
    h.u64(len(seed.tensors))
    h.u64(len(seed.kvs))
    for key, vtype, etype, value in seed.kvs:
        h.string(key)
        h.u32(vtype)
        h.value(vtype, etype, value)
    for name, dims, ttype, offset in seed.tensors:
        h.string(name)
        h.u32(len(dims))
        for d in dims:
            h.u64(d)
        h.u32(ttype)
        h.u64(offset)
    return h


# --------------------------------------------------------------------------------------- mutations
HOSTILE_TEMPLATES = (
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "{% for i in range(10**10) %}x{% endfor %}",
    "{{ 10**10**10 }}",
    "{{ 'a' * 10**9 }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ raise_exception('nope') }}",
    "{% for m in messages %}{{ m.content }",
)


def _semantic(seed: Seed, rng: random.Random) -> None:
    """Change one metadata value: a wrong type, an edge number, or hostile content."""
    kv = rng.choice(seed.kvs)
    key, vtype, etype, value = kv
    choice = rng.randrange(9)
    if choice == 0:  # wrong type, plausible value
        kv[1], kv[2], kv[3] = rng.choice([(T.STRING, None, "12"), (T.UINT32, None, 7), (T.FLOAT32, None, 1.5),
                                          (T.BOOL, None, True), (T.ARRAY, T.INT32, [1, 2, 3]),
                                          (T.ARRAY, T.STRING, ["a", "b c"]), (T.INT64, None, -5),
                                          (T.ARRAY, T.ARRAY, [[1], [2]])])
        if kv[2] == T.ARRAY:
            kv[1], kv[2], kv[3] = T.ARRAY, T.STRING, ["x y"]
    elif choice == 1 and vtype not in (T.STRING, T.ARRAY):  # edge numbers
        kv[1], kv[3] = rng.choice([(T.UINT64, rng.choice(HUGE)), (T.INT64, -rng.choice(HUGE[:8])),
                                   (T.FLOAT64, rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e308])),
                                   (T.INT32, 0), (T.INT32, -1)])
    elif choice == 2 and vtype == T.ARRAY and isinstance(value, list) and value:  # damaged array items
        items = list(value)
        for _ in range(rng.randint(1, 5)):
            i = rng.randrange(len(items))
            if etype == T.STRING:
                items[i] = rng.choice(["", " ", "a b c", "\ufffd", items[rng.randrange(len(items))], "x" * 300])
            elif etype in (T.FLOAT32, T.FLOAT64):
                items[i] = rng.choice([float("nan"), float("inf"), -1e30])
            else:
                items[i] = rng.choice([0, 1, 3, 4, 6, 127, 255 if etype in (T.UINT8, T.INT32, T.UINT32) else 1])
        kv[3] = items
    elif choice == 3 and vtype == T.ARRAY:  # shortened or emptied arrays
        kv[3] = list(value)[: rng.choice([0, 1, 2, len(value) // 2])]
    elif choice == 4:  # a key removed
        seed.kvs.remove(kv)
    elif choice == 5:  # a hostile or broken chat template
        tpl = next((k for k in seed.kvs if k[0] == "tokenizer.chat_template"), None)
        if tpl is not None:
            text = str(tpl[3])  # (an earlier mutation may have made it a number)
            tpl[1], tpl[2] = T.STRING, None
            tpl[3] = rng.choice(HOSTILE_TEMPLATES) if rng.random() < 0.7 else text[: rng.randrange(len(text) + 1)]
    elif choice == 6 and seed.tensors:  # tensor shape/type/offset edits
        t = rng.choice(seed.tensors)
        part = rng.randrange(3)
        if part == 0:
            t[1] = tuple(rng.choice([0, 1, 7, 2**31, 2**40, 2**63 - 1]) if rng.random() < 0.5 else d for d in t[1])
        elif part == 1:
            t[2] = rng.choice([0, 1, 2, 3, 8, 12, 14, 30, 39, 40, 99, 2**31])
        else:
            t[3] = rng.choice([1, 31, t[3] + 1, 2**62, seed.size, 2**64 - 32])
    elif choice == 7 and seed.tensors:  # duplicated or dropped tensor
        t = rng.choice(seed.tensors)
        (seed.tensors.append(list(t)) if rng.random() < 0.5 else seed.tensors.remove(t))
    elif choice == 8:  # special token ids out of range
        for k in seed.kvs:
            if k[0].endswith("_token_id"):
                k[1], k[3] = T.UINT32, rng.choice([VOCAB, VOCAB - 1, 2**32 - 1, 0])


def _bytes(h: Header, rng: random.Random) -> tuple[bytearray, bool]:
    """Damage the serialized header; returns (bytes, truncated)."""
    data = h.data
    choice = rng.randrange(6)
    if choice == 0:  # truncation: anywhere, or right at a field
        cut = rng.choice([rng.randrange(len(data)), rng.choice(h.u64s + h.u32s) + rng.randrange(-2, 9)])
        return data[: max(0, cut)], True
    if choice == 1:  # bit flips
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif choice == 2:  # a count, length, dimension or offset made huge or off by a little
        for _ in range(rng.randint(1, 3)):
            at = rng.choice(h.u64s)
            old = struct.unpack_from("<Q", data, at)[0]
            new = rng.choice([*HUGE, old + 1, max(0, old - 1), old * 2, len(data)])
            struct.pack_into("<Q", data, at, new & 0xFFFFFFFFFFFFFFFF)
    elif choice == 3:  # a value type, array element type, n_dims or tensor type changed
        for _ in range(rng.randint(1, 3)):
            struct.pack_into("<I", data, rng.choice(h.u32s), rng.choice([*range(14), 13, 255, 2**31, 2**32 - 1]))
    elif choice == 4:  # bytes inserted or deleted (everything after shifts)
        at = rng.randrange(len(data))
        if rng.random() < 0.5:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            del data[at : at + rng.randint(1, 16)]
    else:  # random bytes over a field
        at = rng.choice(h.u64s + h.u32s)
        data[at : at + 8] = bytes(rng.randrange(256) for _ in range(8))
    return data, False


def make_case(seeds: list[Seed], i: int) -> tuple[bytes, int]:
    """Case i: (header bytes, size to extend the file to, 0 = leave it truncated)."""
    rng = random.Random(i)
    # The mutations replace values, keys and tensors, never change a value in place: copying the lists that
    # hold them is a deep copy as far as they can tell, without copying every token string of the vocabulary.
    base = seeds[i % len(seeds)]
    seed = Seed(base.name, base.size, [list(kv) for kv in base.kvs], [list(t) for t in base.tensors])
    for _ in range(rng.choice([0, 1, 1, 1, 2])):
        _semantic(seed, rng)
    h = serialize(seed)
    truncated = False
    for _ in range(rng.choice([0, 1, 1, 1, 2])):
        if truncated or not h.data:
            break
        h.data, truncated = _bytes(h, rng)
    return bytes(h.data), 0 if truncated else seed.size


# ------------------------------------------------------------------------------------------ targets
def _case_file(seeds: list[Seed], i: int, folder: Path) -> Path:
    data, size = make_case(seeds, i)
    path = folder / "case.gguf"
    with path.open("wb") as f:
        f.write(data)
        if size > len(data):
            f.truncate(size)  # sparse: the tensor data region reads as zeros
    return path


def gguf_target(seeds: list[Seed], i: int, folder: Path) -> str:
    """The GGUF parser, then the tokenizer and chat template built from what it read."""
    from speculant.errors import SpeculantError
    from speculant.gguf_file import GGUFFile
    from speculant.text.tokenizer import Tokenizer

    try:
        _use_tokenizer(Tokenizer.from_gguf(GGUFFile(_case_file(seeds, i, folder)).fields))
    except SpeculantError:
        return "error"
    return "ok"


def gguf_config_target(seeds: list[Seed], i: int, folder: Path) -> str:
    """The model config a GGUF load derives from the header (models/load_gguf.py)."""
    from speculant.errors import SpeculantError
    from speculant.models.load_gguf import GGUFSource

    try:
        GGUFSource(_case_file(seeds, i, folder))
    except SpeculantError:
        return "error"
    return "ok"


def _use_tokenizer(tok) -> None:
    ids = tok.encode("Hello, world! def f(x):\n    return x + 1  # ünïcödé 你好")
    tok.decode(ids)
    detok = tok.detokenizer()
    "".join(detok.push(t) for t in ids) + detok.flush()
    tok.token_strings()
    if tok.chat_template is not None:
        tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])


def json_seeds() -> list[dict[str, str]]:
    """HF tokenizer folders (tokenizer.json, tokenizer_config.json) rebuilt from the GGUF seeds."""
    from speculant.text.tokenizer import Tokenizer

    out = []
    for seed in load_seeds():
        fields = {k: v for k, _, _, v in seed.kvs}
        tok = Tokenizer.from_gguf(fields)
        config = {"bos_token": tok._token(tok.bos_id) or None, "eos_token": tok._token(tok.eos_id) or None,
                  "add_bos_token": tok.add_bos, "chat_template": tok.chat_template}
        out.append({"tokenizer.json": tok._backend.to_str(), "tokenizer_config.json": json.dumps(config)})
    return out


def _json_leaf(rng: random.Random, old: object) -> object:
    return rng.choice([None, True, 0, -1, 2**31, 2**63, 10**30, 1.5, float("nan") if rng.random() < 0.1 else 0.0,
                       "", "x", "\ufffd" * 3, [], {}, [[[[[]]]]], {"a": {"b": None}}, list(range(5)),
                       [2**40, "x"], "<|im_end|>", {"content": 7}])


def json_target(seeds: list[dict[str, str]], i: int, folder: Path) -> str:
    """A Hugging Face tokenizer folder with a damaged tokenizer.json or tokenizer_config.json."""
    from speculant.errors import SpeculantError
    from speculant.text.tokenizer import Tokenizer

    rng = random.Random(i)
    files = dict(seeds[i % len(seeds)])
    name = rng.choice(sorted(files))
    text = files[name]
    if rng.random() < 0.3:  # bytes: truncated or flipped
        data = bytearray(text.encode())
        if rng.random() < 0.5:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        files[name] = data.decode("utf-8", "replace")
    else:
        tree = json.loads(text)
        for _ in range(rng.randint(1, 3)):
            tree = mutate_tree(tree, rng, _json_leaf)
        files[name] = json.dumps(tree)
    for fname, content in files.items():
        (folder / fname).write_text(content, encoding="utf-8", errors="surrogatepass")
    try:
        _use_tokenizer(Tokenizer.from_hf_dir(folder))
    except SpeculantError:
        return "error"
    return "ok"


TARGETS = {"gguf": (load_seeds, gguf_target), "gguf-config": (load_seeds, gguf_config_target),
           "hf-tokenizer": (json_seeds, json_target), "hf-config": (config_seeds, config_target)}


# ------------------------------------------------------------------------------------------- runner
@dataclass
class Report:
    cases: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # ok / error
    bugs: list[tuple[int, str]] = field(default_factory=list)  # exceptions other than SpeculantError
    hangs: list[int] = field(default_factory=list)
    crashes: list[int] = field(default_factory=list)  # the worker died
    seconds: float = 0.0
    slowest: float = 0.0


def _worker(target: str, cases: list[int], conn, extra_bytes: int) -> None:
    seeds_fn, run = TARGETS[target]
    seeds = seeds_fn()
    with open("/proc/self/statm") as f:  # address space now, plus what a case may legitimately map
        vsize = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vsize + extra_bytes, resource.RLIM_INFINITY))
    conn.send(("ready",))
    with tempfile.TemporaryDirectory(prefix="speculant-fuzz-") as tmp:
        for i in cases:
            t0 = time.perf_counter()
            try:
                outcome, detail = run(seeds, i, Path(tmp)), ""
            except BaseException as e:  # noqa: BLE001 - every escape is the finding
                outcome, detail = "bug", f"{type(e).__name__}: {e}"[:300] + " | " + \
                    " < ".join(f"{fr.name}:{fr.lineno}" for fr in traceback.extract_tb(e.__traceback__)[-4:])
            conn.send(("done", i, outcome, detail, time.perf_counter() - t0))
    conn.send(("finished",))


def run(target: str, cases: range | list[int], *, workers: int = 1, case_seconds: float = CASE_SECONDS) -> Report:
    """Run `cases` of `target` across `workers` processes; hangs and crashes are recorded, not suffered."""
    seeds_fn, _ = TARGETS[target]
    extra = max((p.stat().st_size for p in seed_files()), default=0) + (3 << 30)
    ctx = mp.get_context("spawn")
    report = Report()
    t_start = time.perf_counter()
    queues = [list(cases)[w::workers] for w in range(workers)]
    while any(queues):
        live = []
        for w, queue in enumerate(queues):
            if queue:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(target, queue, child, extra), daemon=True)
                proc.start()
                child.close()
                live.append((w, proc, parent))
        for w, proc, conn in live:
            queue = queues[w]
            limit = 120.0  # worker start-up: imports and seeds
            while queue:
                if not conn.poll(limit):
                    report.hangs.append(queue.pop(0))
                    proc.kill()
                    break
                try:
                    msg = conn.recv()
                except EOFError:
                    report.crashes.append(queue.pop(0))
                    break
                limit = case_seconds
                if msg[0] == "done":
                    _, i, outcome, detail, secs = msg
                    queue.remove(i)
                    report.cases += 1
                    report.slowest = max(report.slowest, secs)
                    if outcome == "bug":
                        report.bugs.append((i, detail))
                    else:
                        report.outcomes[outcome] = report.outcomes.get(outcome, 0) + 1
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        report.cases += 0
    report.cases += len(report.hangs) + len(report.crashes)
    report.seconds = time.perf_counter() - t_start
    return report


def replay(target: str, i: int) -> str:
    """Run case i in this process (for debugging a finding)."""
    seeds_fn, fn = TARGETS[target]
    with tempfile.TemporaryDirectory() as tmp:
        return fn(seeds_fn(), i, Path(tmp))


def summary(target: str, report: Report) -> str:
    return json.dumps({"target": target, "cases": report.cases, **report.outcomes, "bugs": len(report.bugs),
                       "hangs": len(report.hangs), "crashes": len(report.crashes),
                       "seconds": round(report.seconds, 1), "slowest_case_s": round(report.slowest, 3)})
