"""Every decoding method, one line each: the CLI's and the server's choices, `bench`'s lists and the engine's
drafters all come from here.

A method is a file in this folder that declares its `MethodSpec` (base.py: name, what it loads, whether it
verifies trees, which options it takes, how its drafter is built) plus its line below. The order is the
order users see.
"""

from __future__ import annotations

from . import assistant, dflash, draft_model, draft_tree, eagle, hybrid, lookup, lookup_tree, medusa, mtp
from .base import MethodSpec

AR = MethodSpec("ar", "plain decoding: one target step per token (the baseline)", build=None)

METHOD_SPECS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    AR,
    draft_model.SPEC,
    lookup.SPEC,
    hybrid.SPEC,
    lookup_tree.SPEC,
    draft_tree.SPEC,
    medusa.SPEC,
    eagle.EAGLE2,
    eagle.EAGLE3,
    mtp.SPEC,
    dflash.SPEC,
    assistant.SPEC,
)}
