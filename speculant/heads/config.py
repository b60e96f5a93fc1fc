"""The shape of a draft head: which method, how big, which target layers it reads.

One `HeadConfig` describes every head speculant runs or trains (Medusa, EAGLE-2, EAGLE-3), whatever
layout its checkpoint came in (formats.py maps the layouts onto it). Feature conventions:

- medusa, eagle2 read the target's last hidden state after its final norm (what the target's
  output layer reads): `taps = (FINAL_HIDDEN,)` (-1).
- eagle3 reads the raw residual stream after a low, a middle and a high layer (EAGLE-3's layers 2,
  N/2 and N-3 counted as "input of layer i", i.e. our taps 1, N/2-1, N-4), fused by `fc`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import SpeculantError
from ..models.transformer import FINAL_HIDDEN

HEAD_METHODS = ("medusa", "eagle2", "eagle3")
# what `train-heads` trains: these heads, and DFlash block drafters (dflash.py, saved in z-lab's layout)
TRAINABLE = (*HEAD_METHODS, "dflash")


@dataclass(frozen=True, slots=True)
class HeadConfig:
    method: str
    hidden: int  # the target's hidden size D (the head works at the same width)
    vocab: int  # the target's vocabulary (embedding rows)
    draft_vocab: int  # tokens the head can propose (its output rows); d2t maps them to target ids
    taps: tuple[int, ...]  # target layers whose residual output feeds the head; -1 = FINAL_HIDDEN (normed)
    # medusa
    medusa_heads: int = 0
    medusa_layers: int = 1
    shared_lm_head: bool = True  # one output layer for all Medusa heads (ours) or one per head (FasterDecoding)
    # eagle2 / eagle3: one Llama decoder layer
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    intermediate: int = 0
    norm_eps: float = 1e-6
    fc_bias: bool = False
    qkv_bias: bool = False
    norm_before_residual: bool = False  # speculators' eagle3 option: hidden_norm before the residual is kept
    # speculators' eagle3 options: RMSNorm of the taps before fc, over their concatenation ("concat",
    # norm_before_fc) or of each tap ("per_tap", fc_norm); feed the normed output back between steps
    feature_norm: str = "none"
    norm_output: bool = False
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary (speculators' qwen3 layer)
    own_lm_head: bool = True  # eagle2 (EAGLE-1 layout) reuses the target's output rows instead
    # The layer's own rotary inverse frequencies (head_dim/2; a published drafter's rope_theta and
    # rope_scaling); empty: the target's rotary tables, as heads trained here use.
    rope_inv_freq: tuple[float, ...] = ()
    target: str = ""  # the target this head was made for (a name, for messages)

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise SpeculantError(f"unknown head method {self.method!r}; choose one of {', '.join(HEAD_METHODS)}")
        if self.hidden < 1 or self.vocab < 1:
            raise SpeculantError(f"a head needs hidden >= 1 and vocab >= 1, got {self.hidden} and {self.vocab}")
        if not 1 <= self.draft_vocab <= self.vocab:
            raise SpeculantError(f"draft vocabulary must be in 1..{self.vocab} (the target's), got {self.draft_vocab}")
        if not self.taps or any(t < -1 for t in self.taps):
            raise SpeculantError(f"a head needs target layers to read (layer ids, or -1 for the final normed hidden state), got {self.taps}")
        if self.method == "medusa":
            if self.medusa_heads < 1 or self.medusa_layers < 1:
                raise SpeculantError(f"medusa needs >= 1 heads of >= 1 layers, got {self.medusa_heads} x {self.medusa_layers}")
            if len(self.taps) != 1:
                raise SpeculantError("medusa heads read one target layer (the last)")
            return
        if min(self.n_heads, self.n_kv_heads, self.head_dim, self.intermediate) < 1:
            raise SpeculantError(f"{self.method} needs n_heads, n_kv_heads, head_dim, intermediate >= 1")
        if self.n_heads % self.n_kv_heads:
            raise SpeculantError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.feature_norm not in ("none", "concat", "per_tap"):
            raise SpeculantError(f"feature_norm must be none, concat or per_tap, got {self.feature_norm!r}")
        if self.rope_inv_freq and len(self.rope_inv_freq) != self.head_dim // 2:
            raise SpeculantError(f"rope_inv_freq has {len(self.rope_inv_freq)} frequencies; head_dim {self.head_dim} "
                                 f"needs {self.head_dim // 2}")
        if self.method == "eagle3" and len(self.taps) < 2:
            raise SpeculantError("eagle3 fuses several target layers; give at least 2 taps")
        if self.method == "eagle2" and len(self.taps) != 1:
            raise SpeculantError("eagle2 reads one target layer (the last)")

    @property
    def feature_dim(self) -> int:
        """Width of the target features the head reads (taps concatenated)."""
        return self.hidden * len(self.taps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["taps"] = list(self.taps)
        d["rope_inv_freq"] = list(self.rope_inv_freq)
        return d

    @staticmethod
    def from_dict(d: dict) -> "HeadConfig":
        names = set(HeadConfig.__dataclass_fields__)
        unknown = set(d) - names
        if unknown:
            raise SpeculantError(f"unknown head config keys {sorted(unknown)}")
        try:
            return HeadConfig(**{**d, "taps": tuple(int(t) for t in d.get("taps", ())),
                                 "rope_inv_freq": tuple(float(f) for f in d.get("rope_inv_freq", ()))})
        except (TypeError, ValueError) as e:
            raise SpeculantError(f"bad head config: {e}") from None


def default_config(method: str, target, draft_vocab: int, *, medusa_heads: int = 4,
                   intermediate: int | None = None) -> HeadConfig:
    """The head speculant trains for `target` (a models.ModelConfig)."""
    n = target.n_layers
    common = dict(hidden=target.dim, vocab=target.vocab_size, draft_vocab=min(draft_vocab, target.vocab_size),
                  norm_eps=target.norm_eps)
    if method == "medusa":
        return HeadConfig("medusa", taps=(FINAL_HIDDEN,), medusa_heads=medusa_heads, **common)
    layer = dict(n_heads=target.n_heads, n_kv_heads=target.n_kv_heads, head_dim=target.head_dim,
                 intermediate=intermediate or target.hidden_dim)
    if method == "eagle2":
        return HeadConfig("eagle2", taps=(FINAL_HIDDEN,), fc_bias=True, own_lm_head=False, **layer, **common)
    if method == "eagle3":
        taps = tuple(sorted({min(1, n - 1), max(n // 2 - 1, 0), max(n - 4, 0)}))
        if len(taps) < 3:  # tiny targets: the first layers
            taps = tuple(range(min(3, n)))
        return HeadConfig("eagle3", taps=taps, **layer, **common)
    raise SpeculantError(f"unknown head method {method!r}; choose one of {', '.join(HEAD_METHODS)}")
