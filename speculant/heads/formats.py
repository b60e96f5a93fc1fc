"""Head checkpoints: speculant's own folder, and the layouts other projects publish (published.py reads
EAGLE-3's). Safetensors, or pytorch_model.bin through torch's weights-only loader.

| layout | config.json | tensors |
|---|---|---|
| speculant (ours) | `speculant_head`: HeadConfig, `stats` | this package's module names, `d2t` |
| Medusa (FasterDecoding) | `medusa_num_heads`, `medusa_num_layers` | `medusa_head.{k}.{j}.linear.{weight,bias}`, `medusa_head.{k}.{L}.weight` (full vocabulary) |
| EAGLE-1/2 (yuhuili) | Llama config of the one layer | `fc.{weight,bias}` [D, 2D], `layers.0.self_attn.{q,k,v,o}_proj`, `layers.0.mlp.*`, `layers.0.post_attention_layernorm` (output: the target's own rows) |
| EAGLE-3 (yuhuili, AngelSlim, SpecForge) | Llama config + `draft_vocab_size` | `fc.weight` [D, 3D], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}`, `midlayer.self_attn.*`, `midlayer.mlp.*`, `norm`, `lm_head`, `d2t` (offsets), `t2d` (bool) |
| EAGLE-3 (speculators / vLLM) | `speculators_model_type: eagle3`, `transformer_layer_config`, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids` | as yuhuili with `layers.0.` for `midlayer.` |
| EAGLE-3 (llama.cpp) | one `.gguf` file, general.architecture `eagle3` (gguf_drafter.py) | `fc`, `blk.0.*`, `output`, `d2t` (absolute ids) |

`export_speculators` writes our EAGLE-3 heads in the last layout (what vLLM and SGLang load). An
`embed_tokens.weight` in a checkpoint is ignored: heads read the target's own embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .assistant import is_assistant
from ..errors import SpeculantError
from ..models.transformer import FINAL_HIDDEN
from .config import HeadConfig
from .dflash import is_dflash
from .gguf_drafter import gguf_method, is_gguf, read_gguf_drafter, with_rope_freqs
from .modules import EagleHead, MedusaHeads, build_head
from .published import eagle3_config, is_eagle3, layer_prefix, strip_wrapper, vocab_map

FORMAT_VERSION = 1
_HF_LINEARS = {"o": "self_attn.o_proj", "down": "mlp.down_proj"}


def save_head(head: MedusaHeads | EagleHead, folder: Path, stats: dict | None = None) -> Path:
    """Write `head` as speculant's own checkpoint folder (config.json + model.safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
             for k, v in head.state_dict().items() if k != "t2d"}
    if isinstance(head, EagleHead) and not head.cfg.own_lm_head:
        state.pop("lm_head.weight")  # the target's own rows, attached when the head is used
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    _write_config(folder, {"speculant_head": head.cfg.to_dict(), "format_version": FORMAT_VERSION, "stats": stats or {}})
    return folder


def save_stats(folder: Path, stats: dict) -> None:
    """Replace the `stats` of the speculant checkpoint in `folder` (its weights stay as they are)."""
    cfg = json.loads((folder / "config.json").read_text())
    _write_config(folder, {**cfg, "stats": stats})


def _write_config(folder: Path, cfg: dict) -> None:
    tmp = folder / "config.json.tmp"  # readers (a drafter loading a head mid-training) never see half a file
    tmp.write_text(json.dumps(cfg, indent=1))
    tmp.replace(folder / "config.json")


def load_head(folder: Path, target_cfg) -> tuple[MedusaHeads | EagleHead, dict]:
    """(head in float32, stats) from a checkpoint folder in any layout above; `target_cfg` is the
    target's ModelConfig (shapes are checked against it)."""
    folder = Path(folder)
    if is_gguf(folder):  # llama.cpp's EAGLE-3 drafter GGUF
        head = _eagle3_from(*read_gguf_drafter(folder), target_cfg, folder)
        _check_target(head.cfg, target_cfg, folder)
        return head, {}
    raw = _read_config(folder)
    tensors = _read_tensors(folder)
    if "speculant_head" in raw:
        cfg = HeadConfig.from_dict(raw["speculant_head"])
        head = build_head(cfg)
        _load_state(head, tensors, folder, allow_missing=("t2d",) if cfg.own_lm_head else ("t2d", "lm_head.weight"))
        stats = raw.get("stats", {})
    elif raw.get("speculators_model_type") not in (None, "eagle3"):
        raise SpeculantError(f"{folder}: speculators model type {raw['speculators_model_type']!r} is not supported "
                             "(eagle3 is)")
    elif "medusa_num_heads" in raw:
        head, stats = _medusa_from(raw, tensors, target_cfg, folder), {}
    elif is_eagle3(raw, strip_wrapper(tensors)):
        head, stats = _eagle3_from(raw, tensors, target_cfg, folder), {}
    elif "fc.weight" in tensors and any(k.startswith("layers.0.") for k in tensors):
        head, stats = _eagle2_from(raw, tensors, target_cfg, folder), {}
    else:
        raise SpeculantError(f"{folder}: not a head layout speculant knows (speculant, FasterDecoding Medusa, "
                             "EAGLE, EAGLE-3 yuhuili or speculators)")
    _check_target(head.cfg, target_cfg, folder)
    return head, stats


def head_method(folder: Path) -> str:
    """The method a head folder drafts for (medusa, eagle2, eagle3, dflash, assistant), from its config and tensor
    names (no weights read where they are safetensors)."""
    folder = Path(folder)
    if is_gguf(folder):
        return gguf_method(folder)
    if is_assistant(folder):  # Gemma 4's assistant (heads/assistant.py)
        return "assistant"
    raw = _read_config(folder)
    if "speculant_head" in raw:
        return HeadConfig.from_dict(raw["speculant_head"]).method
    if "medusa_num_heads" in raw:
        return "medusa"
    if is_dflash(raw):
        return "dflash"
    names = _read_tensors(folder, load=False)
    if raw.get("speculators_model_type") == "eagle3" or is_eagle3(raw, strip_wrapper(names)):
        return "eagle3"
    if "fc.weight" in names:
        return "eagle2"
    raise SpeculantError(f"{folder}: not a drafter speculant knows (EAGLE-3 in the EAGLE / AngelSlim, SpecForge or "
                         "speculators layout, EAGLE, Medusa, or heads from `speculant train-heads`)")


def _read_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise SpeculantError(f"{folder} is not a head checkpoint: it has no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise SpeculantError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise SpeculantError(f"{cfg_path}: not a JSON object")
    return raw


def _read_tensors(folder: Path, load: bool = True) -> dict[str, Tensor | None]:
    """The head's tensors by name (load=False: the names only, None for each, where they are safetensors)."""
    # model.safetensors (or its shards) is the head; a training folder also holds checkpoint.safetensors
    files = [f for f in sorted(folder.glob("*.safetensors")) if not f.name.startswith("checkpoint")]
    if not files:
        return _read_bin(folder)
    out: dict[str, Tensor | None] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k) if load else None
        except Exception as e:  # a truncated or foreign file: say which
            raise SpeculantError(f"{f}: not a readable safetensors file ({e})") from None
    return out


def _read_bin(folder: Path) -> dict[str, Tensor]:
    """pytorch_model.bin (some EAGLE-3 drafters ship only that), through torch's weights-only unpickler,
    which builds tensors and plain containers and refuses anything that would run code."""
    bins = sorted(folder.glob("pytorch_model*.bin"))
    others = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt") and p not in bins]
    if not bins:
        hint = (f" ({', '.join(others)}: pickle files other than pytorch_model.bin are not read; convert them to "
                "safetensors)") if others else ""
        raise SpeculantError(f"{folder}: no .safetensors weights{hint}")
    out: dict[str, Tensor] = {}
    for f in bins:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise SpeculantError(f"{f}: not a weights-only pickle torch can read safely ({type(e).__name__}: "
                                 f"{str(e)[:200]}); convert it to model.safetensors (safetensors.torch.save_file of "
                                 "its state dict) or use a safetensors copy of the drafter") from None
        if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
            raise SpeculantError(f"{f}: not a state dict of tensors")
        out.update(state)
    return out


def _load_state(head, tensors: dict[str, Tensor], folder: Path, allow_missing: tuple[str, ...] = ()) -> None:
    own = head.state_dict()
    missing = [k for k in own if k not in tensors and k not in allow_missing]
    unexpected = [k for k in tensors if k not in own and k != "embed_tokens.weight"]
    if missing or unexpected:
        raise SpeculantError(f"{folder}: tensors do not match the head's config (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")
    for k, v in own.items():
        if k in tensors and tuple(tensors[k].shape) != tuple(v.shape):
            raise SpeculantError(f"{folder}: tensor {k} has shape {tuple(tensors[k].shape)}, the config says {tuple(v.shape)}")
    head.load_state_dict({k: tensors[k].to(v.dtype) if k in tensors else v for k, v in own.items()})
    if "d2t" in tensors:
        head.set_vocab(tensors["d2t"])


def _check_target(cfg: HeadConfig, t, folder: Path) -> None:
    if cfg.hidden != t.dim or cfg.vocab > t.vocab_size:
        raise SpeculantError(f"{folder}: the head was made for a target of width {cfg.hidden} and {cfg.vocab} tokens; "
                             f"this target has {t.dim} and {t.vocab_size}" + (f" (head trained for {cfg.target})" if cfg.target else ""))
    bad = [x for x in cfg.taps if x != FINAL_HIDDEN and not 0 <= x < t.n_layers]
    if bad:
        raise SpeculantError(f"{folder}: the head reads target layers {bad}, but the target has {t.n_layers}")


def _need(tensors: dict[str, Tensor], key: str, folder: Path) -> Tensor:
    if key not in tensors:
        raise SpeculantError(f"{folder}: tensor {key} is missing")
    return tensors[key].float()


def _layer_shape(c: dict, folder: Path) -> dict:
    try:
        H, D = int(c["num_attention_heads"]), int(c["hidden_size"])
        return dict(hidden=D, n_heads=H, n_kv_heads=int(c.get("num_key_value_heads", H)),
                    head_dim=int(c.get("head_dim") or D // H), intermediate=int(c["intermediate_size"]),
                    norm_eps=float(c.get("rms_norm_eps", 1e-6)))
    except (KeyError, TypeError, ValueError) as e:
        raise SpeculantError(f"{folder}/config.json lacks a usable layer shape ({e})") from None


def _layer_from_hf(head: EagleHead, t: dict[str, Tensor], p: str, folder: Path) -> dict[str, Tensor]:
    """Our layer's tensors from HF Llama names under prefix p."""
    out = {"layer.qkv.weight": torch.cat([_need(t, f"{p}self_attn.{n}_proj.weight", folder) for n in "qkv"]),
           "layer.gate_up.weight": torch.cat([_need(t, f"{p}mlp.{n}_proj.weight", folder) for n in ("gate", "up")]),
           "layer.post_norm": _need(t, f"{p}post_attention_layernorm.weight", folder)}
    for ours, hf in _HF_LINEARS.items():
        out[f"layer.{ours}.weight"] = _need(t, f"{p}{hf}.weight", folder)
    if head.cfg.qk_norm:
        out["layer.q_norm"] = _need(t, f"{p}self_attn.q_norm.weight", folder)
        out["layer.k_norm"] = _need(t, f"{p}self_attn.k_norm.weight", folder)
    if head.cfg.qkv_bias:
        out["layer.qkv.bias"] = torch.cat([_need(t, f"{p}self_attn.{n}_proj.bias", folder) for n in "qkv"])
    return out


def _eagle2_from(c: dict, t: dict[str, Tensor], target_cfg, folder: Path) -> EagleHead:
    shape = _layer_shape(c, folder)
    cfg = HeadConfig("eagle2", vocab=target_cfg.vocab_size, draft_vocab=target_cfg.vocab_size, taps=(FINAL_HIDDEN,),
                     fc_bias="fc.bias" in t, qkv_bias="layers.0.self_attn.q_proj.bias" in t, own_lm_head=False, **shape)
    head = EagleHead(cfg)
    state = {"fc.weight": _need(t, "fc.weight", folder), **_layer_from_hf(head, t, "layers.0.", folder)}
    if cfg.fc_bias:
        state["fc.bias"] = t["fc.bias"].float()
    _load_state(head, state, folder, allow_missing=("t2d", "d2t", "lm_head.weight"))
    return head


def _eagle3_from(raw: dict, t: dict[str, Tensor], target_cfg, folder: Path) -> EagleHead:
    t = strip_wrapper(t)
    cfg = with_rope_freqs(eagle3_config(raw, t, target_cfg, folder), t, folder)
    p = layer_prefix(t)
    fc = _need(t, "fc.weight", folder)
    if tuple(fc.shape) != (cfg.hidden, cfg.feature_dim):
        raise SpeculantError(f"{folder}: fc has shape {tuple(fc.shape)}; {len(cfg.taps)} target layers of width "
                             f"{cfg.hidden} need ({cfg.hidden}, {cfg.feature_dim})")
    head = EagleHead(cfg)
    state = {"fc.weight": fc, "lm_head.weight": _need(t, "lm_head.weight", folder), "norm": _need(t, "norm.weight", folder),
             "input_norm": _need(t, f"{p}input_layernorm.weight", folder),
             "hidden_norm": _need(t, f"{p}hidden_norm.weight", folder), **_layer_from_hf(head, t, p, folder)}
    if cfg.fc_bias:
        state["fc.bias"] = t["fc.bias"].float()
    if cfg.feature_norm == "concat":  # speculators' norm_before_fc
        state["feature_norm"] = _need(t, "input_norm.weight", folder)
    elif cfg.feature_norm == "per_tap":  # speculators' fc_norm
        state["feature_norm"] = torch.stack([_need(t, f"fc_norm.{i}.weight", folder) for i in range(len(cfg.taps))])
    _load_state(head, state, folder, allow_missing=("t2d", "d2t"))
    ids = vocab_map(t, cfg, folder)
    if ids is not None:
        head.set_vocab(ids)
    return head


def _medusa_from(c: dict, t: dict[str, Tensor], target_cfg, folder: Path) -> MedusaHeads:
    t = {k.removeprefix("medusa_head."): v for k, v in t.items()}
    K, L = int(c["medusa_num_heads"]), int(c.get("medusa_num_layers", 1))
    out = _need(t, f"0.{L}.weight", folder)
    cfg = HeadConfig("medusa", hidden=out.shape[1], vocab=target_cfg.vocab_size, draft_vocab=out.shape[0],
                     taps=(FINAL_HIDDEN,), medusa_heads=K, medusa_layers=L, shared_lm_head=False)
    head = MedusaHeads(cfg)
    state = {}
    for k in range(K):
        for j in range(L):
            state[f"blocks.{k}.{j}.weight"] = _need(t, f"{k}.{j}.linear.weight", folder)
            state[f"blocks.{k}.{j}.bias"] = _need(t, f"{k}.{j}.linear.bias", folder)
        state[f"lm_heads.{k}.weight"] = _need(t, f"{k}.{L}.weight", folder)
    _load_state(head, state, folder, allow_missing=("t2d", "d2t"))
    return head


def export_speculators(head: EagleHead, folder: Path, target_cfg, target_name: str = "") -> Path:
    """Write an EAGLE-3 head in the speculators layout (config.json + model.safetensors)."""
    cfg = head.cfg
    if cfg.method != "eagle3":
        raise SpeculantError(f"only eagle3 heads export to the speculators layout (this one is {cfg.method})")
    s = {k: v.detach().float() for k, v in head.state_dict().items()}
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = s["layer.qkv.weight"].split([H * hd, Hkv * hd, Hkv * hd])
    gate, up = s["layer.gate_up.weight"].split(cfg.intermediate)
    p = "layers.0."
    out = {"fc.weight": s["fc.weight"], "norm.weight": s["norm"], "lm_head.weight": s["lm_head.weight"],
           f"{p}input_layernorm.weight": s["input_norm"], f"{p}hidden_norm.weight": s["hidden_norm"],
           f"{p}post_attention_layernorm.weight": s["layer.post_norm"], f"{p}self_attn.o_proj.weight": s["layer.o.weight"],
           f"{p}mlp.gate_proj.weight": gate, f"{p}mlp.up_proj.weight": up, f"{p}mlp.down_proj.weight": s["layer.down.weight"],
           "d2t": head.d2t - torch.arange(cfg.draft_vocab), "t2d": head.t2d >= 0}
    if cfg.qk_norm:
        out[f"{p}self_attn.q_norm.weight"], out[f"{p}self_attn.k_norm.weight"] = s["layer.q_norm"], s["layer.k_norm"]
    if cfg.feature_norm == "concat":
        out["input_norm.weight"] = s["feature_norm"]
    elif cfg.feature_norm == "per_tap":
        out.update({f"fc_norm.{i}.weight": w for i, w in enumerate(s["feature_norm"])})
    for n, w in zip("qkv", qkv):
        out[f"{p}self_attn.{n}_proj.weight"] = w
    if cfg.qkv_bias:
        for n, b in zip("qkv", s["layer.qkv.bias"].split([H * hd, Hkv * hd, Hkv * hd])):
            out[f"{p}self_attn.{n}_proj.bias"] = b
    if cfg.fc_bias:
        out["fc.bias"] = s["fc.bias"]
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    layer = {"model_type": "qwen3" if cfg.qk_norm else "llama",
             "architectures": ["Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"], "hidden_size": cfg.hidden,
             "intermediate_size": cfg.intermediate, "num_attention_heads": H, "num_key_value_heads": Hkv,
             "head_dim": hd, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
             "vocab_size": cfg.vocab, "rope_theta": target_cfg.rope_base, "max_position_embeddings": target_cfg.context_length,
             "attention_bias": cfg.qkv_bias, "mlp_bias": False, "tie_word_embeddings": False}
    if target_cfg.rope_scaling is not None:  # the head rotates with the target's tables: their Llama 3 scaling too
        r = target_cfg.rope_scaling
        layer["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                                 "high_freq_factor": r.high_freq_factor,
                                 "original_max_position_embeddings": r.original_max_position_embeddings}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.1.0",
              "draft_vocab_size": cfg.draft_vocab, "norm_before_residual": cfg.norm_before_residual,
              "norm_before_fc": cfg.feature_norm == "concat", "fc_norm": cfg.feature_norm == "per_tap",
              "norm_output": cfg.norm_output,
              "target_hidden_size": cfg.hidden, "eagle_aux_hidden_state_layer_ids": [x + 1 for x in cfg.taps],
              "transformer_layer_config": layer, "torch_dtype": "float32",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                     "verifier": {"name_or_path": target_name or cfg.target,
                                                  "architectures": ["Qwen2ForCausalLM" if target_cfg.arch == "qwen2" else "LlamaForCausalLM"]}}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
