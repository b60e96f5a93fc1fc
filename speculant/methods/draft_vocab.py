"""Can this draft model draft for this target? Same tokenizer, or speculation is meaningless.

Checked up front so that a mismatched pair fails with the first differing token named, instead of
silently drafting garbage (which would stay exact, but never be accepted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SpeculantError

if TYPE_CHECKING:
    from ..models import LoadedModel


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    tt, dt = target.tokenizer, draft.tokenizer
    ts, ds = tt.token_strings(), dt.token_strings()
    if len(ts) != len(ds):
        raise SpeculantError(
            f"draft {draft.name} has a vocabulary of {len(ds)} tokens but target {target.name} has {len(ts)}; "
            "the draft must use the target's tokenizer")
    for i, (a, b) in enumerate(zip(ts, ds)):
        if a != b:
            raise SpeculantError(
                f"draft {draft.name} does not share the target's tokenizer: token {i} is {b!r} in the draft "
                f"but {a!r} in the target; pick a draft from the same model family")
    if (tt.bos_id, tt.eos_id) != (dt.bos_id, dt.eos_id):
        raise SpeculantError(
            f"draft and target disagree on special tokens (BOS/EOS {dt.bos_id}/{dt.eos_id} vs "
            f"{tt.bos_id}/{tt.eos_id}); pick a draft from the same model family")
    # Embedding tables may be padded past the tokenizer; only rows the tokenizer uses must exist.
    for m in (target, draft):
        if m.config.vocab_size < len(ts):
            raise SpeculantError(f"{m.name} has {m.config.vocab_size} embedding rows for {len(ts)} tokens")
