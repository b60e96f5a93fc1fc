"""`--method assistant`: Gemma 4's assistant drafter (heads/assistant.py; --drafter its folder or its GGUF file)
drafting a chain.

A tap drafter (methods/base.py) of the target's final normed hidden state. It keeps the row of the last
committed token; a round starts from it and the pending token, at the pending token's position, over the target's
committed keys/values (read in place from the target's cache: the engine's prompt cache hands it over), and
each further step feeds the drafted token with the assistant's own projected state, at the same position (as
transformers' Gemma4AssistantCandidateGenerator does). Greedy drafts the argmax; sampling draws each token from
the sampler's distribution of the assistant's logits and hands those distributions over as q, so verification
keeps the target's distribution exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..exact.distributions import Dist
from ..heads.assistant import Assistant
from ..models.transformer import FINAL_HIDDEN
from ..exact.sampler import Sampler
from .base import Draft, Drafter, MethodSpec, next_draft


class AssistantDrafter(Drafter):
    name = "assistant"
    taps = (FINAL_HIDDEN,)

    def __init__(self, assistant: Assistant, target, sampler: Sampler, kept) -> None:
        self.assistant, self.target, self.sampler, self.kept = assistant, target, sampler, kept
        self.h: Tensor | None = None  # the target's final hidden state of the last committed token [1, D]

    def start(self, prompt: list[int], hidden: dict[int, Tensor] | None = None) -> None:
        self.h = hidden[FINAL_HIDDEN][-1:].float()

    def commit(self, accepted: list[int], n_drafted: int, *, hidden: dict[int, Tensor] | None = None,
               **_: object) -> None:
        self.h = hidden[FINAL_HIDDEN][-1:].float()

    def propose(self, pending: int, k: int) -> Draft:
        cache = self.kept.cache  # the target's: its committed slots end before the pending token
        committed = cache.length
        sampler = self.sampler
        vocab = self.target.cfg.vocab_size
        tok = torch.tensor([pending], device=self.h.device)
        h, tokens, qs, prefix = self.h, [], [], []
        with torch.inference_mode():
            for _ in range(k):
                x = self.target.embed(tok) * self.assistant.embed_scale
                logits, h = self.assistant.step(cache, committed, committed, x, h)
                logits = logits[:, :vocab]
                tok, q = next_draft(sampler, logits, prefix)
                if q is not None:
                    qs.append(q)
                tokens.append(tok)
                if sampler.penalized:
                    prefix.append(int(tok))
        draft = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=self.h.device)
        return Draft(draft, Dist.cat(qs) if qs else None)


def load_assistant(target, method) -> Assistant:
    """The assistant of `method` (its heads.name: the folder --drafter gave) for a loaded target."""
    from pathlib import Path

    from ..errors import SpeculantError
    from ..heads.assistant import is_assistant
    from ..heads.gguf_drafter import is_gguf

    where = Path(method.heads.name).expanduser() if method.heads.name else None
    if where is not None and is_gguf(where):  # llama.cpp's gemma4-assistant file
        from ..heads.assistant_gguf import load_gguf_assistant

        return load_gguf_assistant(where, target.model)
    if where is None or not is_assistant(where):
        raise SpeculantError("--method assistant needs --drafter PATH: a Gemma 4 assistant's folder "
                             "(config.json with architectures Gemma4AssistantForCausalLM) or its gemma4-assistant "
                             ".gguf file")
    return Assistant(where, target.model)


SPEC = MethodSpec("assistant", "Gemma 4's assistant drafter on the target's last hidden state and its cache "
                  "(--drafter)", build=lambda c: AssistantDrafter(c.head, c.target, c.sampler, c.target_kept),
                  loads="heads", options="drafter", load=lambda t, m: (load_assistant(t, m), {}))
