"""Head checkpoints in every layout speculant reads (synthetic, random weights): loaded heads compute
what an independent HF-style reference computes from the raw tensors; our own format and the
speculators export round-trip; pickle files are refused."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from conftest import tiny_model
from speculant.errors import SpeculantError
from speculant.heads.config import default_config
from speculant.heads.formats import export_speculators, load_head, save_head
from speculant.heads.layer import attend
from speculant.heads.modules import build_head, init_from_target
from speculant.models.cache import KVCache

D, H, HKV, FF = 32, 4, 2, 48
HD = D // H


def _t(*shape, seed=[0]):
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0])) * 0.2


def _layer(prefix: str, in_dim: int, bias: bool = False) -> dict:
    t = {f"{prefix}self_attn.q_proj.weight": _t(H * HD, in_dim), f"{prefix}self_attn.k_proj.weight": _t(HKV * HD, in_dim),
         f"{prefix}self_attn.v_proj.weight": _t(HKV * HD, in_dim), f"{prefix}self_attn.o_proj.weight": _t(D, H * HD),
         f"{prefix}mlp.gate_proj.weight": _t(FF, D), f"{prefix}mlp.up_proj.weight": _t(FF, D),
         f"{prefix}mlp.down_proj.weight": _t(D, FF), f"{prefix}post_attention_layernorm.weight": 1 + _t(D)}
    if bias:
        for n in "qkv":
            t[f"{prefix}self_attn.{n}_proj.bias"] = _t(t[f"{prefix}self_attn.{n}_proj.weight"].shape[0])
    return t


def _llama_config(V: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": D, "intermediate_size": FF, "num_attention_heads": H,
            "num_key_value_heads": HKV, "rms_norm_eps": 1e-6, "vocab_size": V, "num_hidden_layers": 1, "rope_theta": 10000.0}


def _write(folder, tensors: dict, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _reference_layer(t: dict, p: str, x_in, residual, cos, sin):
    """HF Llama attention + MLP over S causal rows, from the raw tensors (rotate-half rope)."""
    S = x_in.shape[0]

    def lin(name, x):
        y = x @ t[f"{p}{name}.weight"].T
        return y + t[f"{p}{name}.bias"] if f"{p}{name}.bias" in t else y

    def rope(x):  # x [S, heads, hd]
        c, s = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        rot = torch.cat([-x[..., HD // 2:], x[..., : HD // 2]], -1)
        return x * c + rot * s

    q = rope(lin("self_attn.q_proj", x_in).view(S, H, HD)).transpose(0, 1)
    k = rope(lin("self_attn.k_proj", x_in).view(S, HKV, HD)).transpose(0, 1).repeat_interleave(H // HKV, 0)
    v = lin("self_attn.v_proj", x_in).view(S, HKV, HD).transpose(0, 1).repeat_interleave(H // HKV, 0)
    a = (q @ k.transpose(1, 2) / HD ** 0.5).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -torch.inf)
    o = lin("self_attn.o_proj", (a.softmax(-1) @ v).transpose(0, 1).reshape(S, D))
    h = residual + o
    m = _rms(h, t[f"{p}post_attention_layernorm.weight"])
    return h + lin("mlp.down_proj", F.silu(lin("mlp.gate_proj", m)) * lin("mlp.up_proj", m))


def _head_pass(head, target, emb, feature):
    cache = KVCache(1, head.cfg.n_kv_heads, head.cfg.head_dim, 64, torch.float32, torch.device("cpu"))
    x, res = head.layer_input(emb, feature)
    S = emb.shape[0]
    return attend(head.layer, x, res, cache, torch.arange(S), None, target.model.cos, target.model.sin)


@pytest.fixture
def target():
    return tiny_model(24, dim=D, heads=H, kv_heads=HKV, layers=6)


def test_eagle3_yuhuili_and_speculators(target, tmp_path):
    V, Vd, S = 24, 10, 5
    d2t = torch.tensor([0, 2, 3, 5, 8, 9, 13, 17, 20, 23])
    for layout in ("yuhuili", "speculators"):
        p = "midlayer." if layout == "yuhuili" else "layers.0."
        t = {"fc.weight": _t(D, 3 * D), "norm.weight": 1 + _t(D), "lm_head.weight": _t(Vd, D),
             f"{p}input_layernorm.weight": 1 + _t(D), f"{p}hidden_norm.weight": 1 + _t(D), **_layer(p, 2 * D),
             "d2t": d2t - torch.arange(Vd), "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, d2t, True),
             "embed_tokens.weight": _t(V, D)}
        if layout == "yuhuili":
            cfg = {**_llama_config(V), "draft_vocab_size": Vd}
        else:
            cfg = {"speculators_model_type": "eagle3", "draft_vocab_size": Vd, "transformer_layer_config": _llama_config(V),
                   "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
        head, _ = load_head(_write(tmp_path / layout, t, cfg), target.config)
        assert head.cfg.method == "eagle3" and torch.equal(head.d2t, d2t)
        assert head.cfg.taps == ((0, 2, 4) if layout == "speculators" else (1, 2, 2))  # yuhuili: 2, N/2, N-3
        feats, emb = _t(S, 3 * D), _t(S, D)
        with torch.no_grad():
            first = head.first_feature(feats)
            got = head.logits(_head_pass(head, target, emb, first))
        hidden = feats @ t["fc.weight"].T
        x = torch.cat([_rms(emb, t[f"{p}input_layernorm.weight"]), _rms(hidden, t[f"{p}hidden_norm.weight"])], -1)
        ref = _reference_layer(t, p, x, hidden, target.model.cos[:S], target.model.sin[:S])
        ref = _rms(ref, t["norm.weight"]) @ t["lm_head.weight"].T
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_eagle_yuhuili_eagle2(target, tmp_path):
    V, S = 24, 6
    t = {"fc.weight": _t(D, 2 * D), "fc.bias": _t(D), **_layer("layers.0.", D, bias=True), "embed_tokens.weight": _t(V, D)}
    head, _ = load_head(_write(tmp_path / "eagle", t, _llama_config(V)), target.config)
    assert head.cfg.method == "eagle2" and not head.cfg.own_lm_head and head.cfg.qkv_bias
    init_from_target(head, target.model)  # EAGLE-1/2 read the target's own output rows
    feats, emb = _t(S, D), _t(S, D)
    with torch.no_grad():
        got = head.logits(_head_pass(head, target, emb, feats))
    x = torch.cat([emb, feats], -1) @ t["fc.weight"].T + t["fc.bias"]
    ref = _reference_layer(t, "layers.0.", x, x, target.model.cos[:S], target.model.sin[:S]) @ target.model.lm_head.weight.T
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_medusa_fasterdecoding(target, tmp_path):
    V, K = 24, 3
    t = {}
    for k in range(K):
        t[f"medusa_head.{k}.0.linear.weight"], t[f"medusa_head.{k}.0.linear.bias"] = _t(D, D), _t(D)
        t[f"medusa_head.{k}.1.weight"] = _t(V, D)
    head, _ = load_head(_write(tmp_path / "medusa", t, {"medusa_num_heads": K, "medusa_num_layers": 1,
                                                         "base_model_name_or_path": "x"}), target.config)
    h = _t(2, D)
    with torch.no_grad():
        got = head(h)
    for k in range(K):
        x = h + F.silu(h @ t[f"medusa_head.{k}.0.linear.weight"].T + t[f"medusa_head.{k}.0.linear.bias"])
        torch.testing.assert_close(got[k], x @ t[f"medusa_head.{k}.1.weight"].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["medusa", "eagle2", "eagle3"])
def test_own_format_round_trip(method, target, tmp_path):
    cfg = default_config(method, target.config, 12)
    head = build_head(cfg)
    head.set_vocab(torch.randperm(24)[:12])
    init_from_target(head, target.model)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(_t(*p.shape))
    save_head(head, tmp_path / method, {"val": {"acc": [0.5]}})
    back, stats = load_head(tmp_path / method, target.config)
    if method == "eagle2":
        init_from_target(back, target.model)
        head.lm_head.weight.data.copy_(back.lm_head.weight)
    assert stats["val"]["acc"] == [0.5]
    for (k, a), (_, b) in zip(sorted(head.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(a, b), k
    if method == "eagle3":  # our head exported in the speculators layout reads back the same
        out = export_speculators(head, tmp_path / "spec", target.config, "tiny")
        assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
        again, _ = load_head(out, target.config)
        assert again.cfg.taps == head.cfg.taps
        feats, emb = _t(4, cfg.feature_dim), _t(4, D)
        with torch.no_grad():
            a = head.logits(_head_pass(head, target, emb, head.first_feature(feats)))
            b = again.logits(_head_pass(again, target, emb, again.first_feature(feats)))
        torch.testing.assert_close(a, b)
        assert torch.equal(again.d2t, head.d2t)


def test_bad_checkpoints(target, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(SpeculantError, match="pickle"):
        load_head(pickled, target.config)
    with pytest.raises(SpeculantError, match="no config.json"):
        load_head(tmp_path, target.config)
    t = {"fc.weight": _t(D, 3 * D), "lm_head.weight": _t(24, D)}
    with pytest.raises(SpeculantError, match="missing"):
        load_head(_write(tmp_path / "partial", t, {"speculators_model_type": "eagle3",
                                                   "transformer_layer_config": _llama_config(24)}), target.config)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    with pytest.raises(SpeculantError, match="JSON"):
        load_head(tmp_path / "junk", target.config)
