"""A trained DFlash pair: speculant's accepted lengths equal the reference loop's and llama.cpp's, round by round.

Random drafters are rarely right, so the other DFlash tests see accepted counts of 0 or 1. Here both models learn:

- the target, a tiny Qwen3 (SmolLM2's tokenizer, which llama.cpp's converter recognizes), is trained with plain torch
  for a few seconds on a small text (the Zen of Python, its lines in seeded orders), so it continues a line the way
  the text does;
- the drafter is trained by speculant's own `train-heads` machinery (training/train.py with method dflash: the
  target's features extracted, DFlash's block objective) on the same text, and saved in z-lab's layout.

Then on a few prompts (greedy, blocks of BLOCK-1 drafts at a fixed length): speculant's output equals `ar`; the mean
accepted length is clearly above what an untrained drafter gets; the accepted drafts per round equal those of z-lab's
dflash_generate loop (tests/dflash_ref.py, recomputed from scratch) and of llama.cpp's llama-speculative-simple
--spec-type draft-dflash on the converted GGUFs (the drafter reads target layers 1, 2, 3: llama.cpp cannot read the
last one).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dflash_ref import ReferenceDFlash, greedy_rounds

from speculant import Engine, GenerationConfig, MethodConfig, drafter_method, load_model
from speculant.decoding.stats import Stats
from speculant.methods.base import DraftLengthConfig
from speculant.methods.dflash import DFlashDrafter
from speculant.methods.governor import GovernorConfig
from speculant.methods.heads import HeadsConfig
from speculant.training.data import DataConfig
from speculant.training.train import TrainConfig, train

pytestmark = pytest.mark.real  # SmolLM2's tokenizer comes from the real preset's GGUF

REAL = "smollm2-135m-instruct"
BLOCK = 8
N = 32  # new tokens per prompt
DOCS = 12  # training documents, each the text's lines in a seeded order, COPIES times
COPIES = 3
SEQ = 64
TARGET_STEPS = 150
EPOCHS = 30  # of the drafter's training
PROMPTS = ("Beautiful is better", "Errors should never", "Special cases aren't", "Now is better")


def zen() -> list[str]:
    """The Zen of Python's lines (the standard library's `this`, which prints them when first imported)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return [line for line in "".join(this.d.get(c, c) for c in this.s).splitlines()[2:] if line]


def write_docs(folder: Path) -> list[Path]:
    lines = zen()
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(DOCS):
        rng = random.Random(i)
        order = [line for _ in range(COPIES) for line in rng.sample(lines, len(lines))]
        (path := folder / f"zen{i:02d}.txt").write_text("\n".join(order) + "\n")
        docs.append(path)
    return docs


def train_target(folder: Path, docs: list[Path]) -> Path:
    """A 6-layer Qwen3 of width 64 trained on `docs` (next-token cross-entropy, AdamW, fixed seeds, plain torch)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from speculant.hub import resolve_model

    real = resolve_model(REAL)
    tok = AutoTokenizer.from_pretrained(str(real.parent), gguf_file=real.name)
    cfg = AutoConfig.for_model("qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    ids = torch.tensor([t for d in docs for t in tok.encode(d.read_text())])
    # the embedding and output rows of the text's own tokens alone are trained (a softmax over SmolLM2's 49,152 tokens
    # and Adam over all their rows would be most of the work); the other rows keep their small initial weights, far
    # below the trained logits
    used, ids = ids.unique(return_inverse=True)
    embed, head = (torch.nn.Parameter(w.weight.detach()[used].clone()) for w in (model.model.embed_tokens, model.lm_head))
    params = [embed, head] + [p for n, p in model.model.named_parameters() if not n.startswith("embed_tokens")]
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(TARGET_STEPS):
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 10)
        starts = torch.randint(0, ids.numel() - SEQ - 1, (8,), generator=g)
        batch = torch.stack([ids[s : s + SEQ + 1] for s in starts.tolist()])
        h = model.model(inputs_embeds=embed[batch[:, :-1]]).last_hidden_state
        loss = F.cross_entropy((h @ head.T).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        model.model.embed_tokens.weight[used] = embed
        model.lm_head.weight[used] = head
    print(f"target: {TARGET_STEPS} steps, last loss {loss.item():.3f}")
    model.eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """The trained target (HF folder) and the DFlash drafter speculant's training made for it, with its stats."""
    root = tmp_path_factory.mktemp("dflash-trained")
    docs = write_docs(root / "text")
    folder = train_target(root / "target", docs)
    target = load_model(str(folder), "float32", progress=False)
    # 30 epochs of 4 steps: the recipe is bounded by epochs; the minutes only guard a stalled host
    tcfg = TrainConfig("dflash", minutes=10.0, batch=8, epochs=EPOCHS, eval_every=10, block=BLOCK, anchors=16,
                       draft_vocab=512)
    stats = train(target, tcfg, DataConfig(seq_len=SEQ, tokens=2048, val_fraction=0.2), docs, root / "heads" / "dflash",
                  progress=False)
    return {"root": root, "docs": docs, "target": folder, "loaded": target, "drafter": root / "heads" / "dflash",
            "stats": stats}


def _method(drafter: Path, fmt: str | None = "float32") -> MethodConfig:
    k = BLOCK - 1
    return drafter_method(str(drafter), MethodConfig(draft_length=DraftLengthConfig(k, "fixed", k),
                                                     governor=GovernorConfig("off"), heads=HeadsConfig(fmt=fmt)))


def test_training_makes_a_drafter_in_z_labs_layout(pair):
    from speculant.heads.formats import head_method

    stats, folder = pair["stats"], pair["drafter"]
    print("held-out before", stats["val_start"], "after", stats["val"])
    assert stats["epochs"] == EPOCHS and stats["steps"] == EPOCHS * 4  # the whole recipe ran, not a time-cut part
    assert stats["val"]["loss"] < stats["val_start"]["loss"]
    assert stats["val"]["chain"] > 2.0 and stats["val_start"]["chain"] < 0.1  # drafts a block keeps, held out
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert head_method(folder) == "dflash" and _method(folder).name == "dflash"


def _rounds(target, drafter: Path, ids: list[int], fmt: str | None = "float32"):
    """speculant's greedy run of N tokens after `ids`: (tokens, drafted chains, accepted count per round)."""
    chains, counts = [], []
    propose, record = DFlashDrafter.propose, Stats.record_round

    def spy_propose(self, pending, k):
        draft = propose(self, pending, k)
        chains.append(draft.tokens.tolist())
        return draft

    def spy_record(self, drafted, accepted):
        counts.append(accepted)
        return record(self, drafted, accepted)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DFlashDrafter, "propose", spy_propose)
        mp.setattr(Stats, "record_round", spy_record)
        done = Engine(target, method=_method(drafter, fmt)).generate(ids, GenerationConfig(max_new_tokens=N, ignore_eos=True))
    return done.token_ids, chains, counts


def _whole(chains: list[list[int]], counts: list[int]) -> list[int]:
    """The accepted counts of the rounds that drafted a whole block (the last may be cut by max_new_tokens)."""
    return [n for c, n in zip(chains, counts) if len(c) == BLOCK - 1]


def test_accepted_lengths_equal_the_reference_loop(pair):
    """Greedy output equals `ar`; every round's accepted drafts equal those of z-lab's dflash_generate loop
    (tests/dflash_ref.py, HF's Qwen3 as the target, everything recomputed from scratch each round)."""
    from transformers import AutoModelForCausalLM

    target = pair["loaded"]
    hf = AutoModelForCausalLM.from_pretrained(str(pair["target"]), dtype=torch.float32).eval()
    ref = ReferenceDFlash(pair["drafter"])
    ours_all, ref_all = [], []
    for prompt in PROMPTS:
        ids = target.tokenizer.encode(prompt)
        ar = Engine(target).generate(ids, GenerationConfig(max_new_tokens=N, ignore_eos=True)).token_ids
        tokens, chains, counts = _rounds(target, pair["drafter"], ids)
        assert tokens == ar, prompt
        ref_tokens, ref_counts = greedy_rounds(ref, hf, ids, N, BLOCK)
        assert ref_tokens[:N] == ar, prompt
        ours = _whole(chains, counts)
        print(f"{prompt!r}: accepted per round {ours}, reference {ref_counts[:len(ours)]}")
        assert ours == ref_counts[: len(ours)], prompt
        ours_all += ours
        ref_all += ref_counts[: len(ours)]
    mean = sum(ours_all) / len(ours_all)
    print(f"mean accepted drafts per round {mean:.2f} (reference {sum(ref_all) / len(ref_all):.2f}) in "
          f"{len(ours_all)} rounds: {mean + 1:.2f} tokens per target pass")
    assert mean > 1.0  # drafts often accepted: more than one per round beside the target's own token


def test_accepted_lengths_equal_llama_cpp(pair):
    """llama-speculative-simple --spec-type draft-dflash on the converted GGUFs (F32, every KV cache f32) accepts, round
    by round, what speculant accepts on the target GGUF with the drafter GGUF: the same drafts and the same counts.
    As in test_dflash_gguf, llama.cpp gets the prompt with speculant's first token appended, so both draft their first
    block from the same state."""
    from llama_cpp_ref import (
        convert_all,
        equal_rounds,
        greedy_tokens,
        llama_cpp_bin,
        speculative_rounds,
    )

    bin_dir = llama_cpp_bin()
    root = pair["root"]
    target_gguf, drafter_gguf = convert_all([
        (pair["target"], root / "target.gguf", ["--outtype", "f32"]),
        (pair["drafter"], root / "dflash.gguf", ["--outtype", "f32", "--target-model-dir", pair["target"]])])
    target = load_model(str(target_gguf), None, progress=False, use_cache=False, kv_dtype="f32")
    k = BLOCK - 1
    ours_all, theirs_all = [], []
    for prompt in PROMPTS:
        ids = target.tokenizer.encode(prompt)
        tokens, chains, counts = _rounds(target, drafter_gguf, ids)
        assert tokens == Engine(target).generate(ids, GenerationConfig(max_new_tokens=N, ignore_eos=True)).token_ids
        text = prompt + target.tokenizer.decode(tokens[:1])
        assert greedy_tokens(bin_dir, target_gguf, text, 1).prompt == ids + tokens[:1]
        # speculant's first round follows the prompt; llama.cpp's, the prompt and that first token
        out, theirs, _, _ = speculative_rounds(bin_dir, target_gguf, text, "draft-dflash", k=k, n=N, drafter=drafter_gguf)
        assert target.tokenizer.decode(ids + tokens) in out  # llama.cpp's text runs on past speculant's N tokens
        whole = _whole(chains, counts)
        same = equal_rounds(chains, counts, theirs, k)
        print(f"{prompt!r}: speculant {whole}, llama.cpp {[r.accepted for r in theirs]}: {same} rounds equal")
        assert same == len(whole), prompt  # every whole-block round alike
        ours_all += whole
        theirs_all += [r.accepted for r in theirs[:same]]
    print(f"mean accepted drafts per round: speculant {sum(ours_all) / len(ours_all):.2f}, llama.cpp "
          f"{sum(theirs_all) / len(theirs_all):.2f} in {len(ours_all)} rounds")
    assert sum(ours_all) / len(ours_all) > 1.0
