"""Which decoding method runs and with what settings: `MethodConfig` and the 'name:key=value' specs
that the command line, the server and the benchmarks parse into one."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import SpeculantError
from .governor import GovernorConfig
from .heads import HeadsConfig
from .base import DraftLengthConfig
from .draft_model import DraftModelConfig
from .draft_tree import DraftTreeConfig
from .hybrid import HybridConfig
from .lookup import LookupConfig
from .lookup_tree import LookupTreeConfig
from .registry import METHOD_SPECS

METHODS = tuple(METHOD_SPECS)
# drafters on the target's hidden states: trained heads or published drafters (speculant/heads)
HEAD_METHODS = tuple(name for name, spec in METHOD_SPECS.items() if spec.loads == "heads")
MODEL_METHODS = tuple(name for name, spec in METHOD_SPECS.items() if spec.loads == "draft")  # need --draft


@dataclass(frozen=True, slots=True)
class MethodConfig:
    name: str = "ar"
    draft_length: DraftLengthConfig = field(default_factory=DraftLengthConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    draft_model: DraftModelConfig = field(default_factory=DraftModelConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    lookup_tree: LookupTreeConfig = field(default_factory=LookupTreeConfig)
    draft_tree: DraftTreeConfig = field(default_factory=DraftTreeConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    governor: GovernorConfig = field(default_factory=GovernorConfig)

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise SpeculantError(f"unknown method {self.name!r}; choose one of {', '.join(METHODS)}")


_SPEC_KEYS = {
    "k": ("draft_length", "k", int), "schedule": ("draft_length", "schedule", str),
    "max_k": ("draft_length", "max_k", int), "conf": ("draft_model", "min_confidence", float),
    "vocab": ("draft_model", "vocab", int), "ngram": ("lookup", "max_ngram", int),
    "ngram_min": ("lookup", "min_ngram", int), "ctx": ("draft_model", "context", int),
    "check": ("hybrid", "check", str),
    "branches": ("lookup_tree", "branches", int), "nodes": ("lookup_tree", "nodes", int),
    "depth": ("lookup_tree", "depth", int), "width": ("draft_tree", "width", int),
    "governor": ("governor", "mode", str),
}
# options of the head methods ('eagle3:nodes=12,depth=6,topk=4,heads=NAME')
_HEAD_KEYS = {"nodes": ("heads", "nodes", int), "depth": ("heads", "depth", int), "topk": ("heads", "topk", int),
              "heads": ("heads", "name", str), "governor": ("governor", "mode", str)}
# options of the chain drafters loaded from a folder ('dflash:max_k=15,heads=PATH'): draft length and folder
_DRAFTER_KEYS = {**{k: _SPEC_KEYS[k] for k in ("k", "schedule", "max_k", "governor")}, "heads": _HEAD_KEYS["heads"]}
_KEYS = {"chain": _SPEC_KEYS, "heads": _HEAD_KEYS, "drafter": _DRAFTER_KEYS}  # by MethodSpec.options


def method_name(spec: str) -> str:
    """The method a spec such as 'draft:k=4' runs ('draft')."""
    return spec.partition(":")[0].strip()


def parse_method(spec: str, base: MethodConfig | None = None) -> MethodConfig:
    """'draft:k=4,schedule=fixed,conf=0.4' -> a MethodConfig (unset fields come from `base`)."""
    opts = spec.partition(":")[2]
    cfg = replace(base or MethodConfig(), name=method_name(spec))
    parts: dict[str, dict[str, object]] = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, eq, value = item.partition("=")
        keys = _KEYS[METHOD_SPECS[cfg.name].options]
        if not eq or key not in keys:
            raise SpeculantError(f"bad method option {item!r} in {spec!r}; use key=value with keys {', '.join(keys)}")
        group, field_name, cast = keys[key]
        try:
            parts.setdefault(group, {})[field_name] = cast(value)
        except ValueError:
            raise SpeculantError(f"method option {key} must be {cast.__name__}, got {value!r}") from None
    dl = cfg.draft_length  # an unset max_k follows k (DraftLengthConfig.limit); a set one grows to k
    if "draft_length" in parts and "k" in parts["draft_length"] and "max_k" not in parts["draft_length"] and \
            dl.max_k is not None:
        parts["draft_length"]["max_k"] = max(dl.max_k, int(parts["draft_length"]["k"]))
    return replace(cfg, **{g: replace(getattr(cfg, g), **kv) for g, kv in parts.items()})


def drafter_method(path: str, base: MethodConfig | None = None) -> MethodConfig:
    """The MethodConfig that runs the drafter in folder `path` (a published EAGLE-3 or DFlash drafter, or any head
    folder; or llama.cpp's EAGLE-3 drafter GGUF file): its method read from its config (`--drafter PATH` on the command line). Use it as
    `Engine(load_model(...), method=drafter_method(PATH))`."""
    from pathlib import Path

    from ..heads.formats import head_method
    from ..heads.gguf_drafter import is_gguf

    where = Path(path).expanduser()
    if not (where / "config.json").is_file() and not is_gguf(where):
        raise SpeculantError(f"drafter {path}: no config.json there (give the drafter's folder: EAGLE-3, DFlash; or "
                             "llama.cpp's EAGLE-3 or DFlash drafter .gguf file)")
    base = base or MethodConfig()
    return replace(base, name=head_method(where), heads=replace(base.heads, name=str(path)))
