"""The cache of a hybrid model (Qwen3.5): keys/values for the attention layers, and for each linear-attention layer
the convolution window and the recurrent state.

A KV cache rolls back by moving its length; a recurrent state cannot be un-applied. So a pass keeps what each of its
positions left behind: the convolution's inputs (the window after position j is a slice of them) and the recurrent
state after every position (the delta rule makes a new state tensor per token anyway; keeping them is no copy).
`rollback(length)` then restores the state after token length-1 exactly, anywhere inside the last pass, or back to
an empty cache. Anything further back was never kept: a clear error, not a silently wrong state. Trees (`keep`)
would need each node's path state: refused (chains only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SpeculantError
from .cache import KVCache


class HybridCache:
    def __init__(self, n_attn: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, n_linear: int, conv_dim: int, conv_kernel: int, v_heads: int, k_dim: int,
                 v_dim: int) -> None:
        self.kv = KVCache(max(n_attn, 1), n_kv_heads, head_dim, max_len, dtype, device)
        self.window = conv_kernel - 1
        self.conv = [torch.zeros(self.window, conv_dim, device=device) for _ in range(n_linear)]
        self.state = [torch.zeros(v_heads, k_dim, v_dim, device=device) for _ in range(n_linear)]
        # the last pass, per linear layer: its convolution inputs [window + S, C] and the states before and after
        # each of its positions (S + 1); `start` its first slot
        self._start = 0
        self._inputs: list[Tensor | None] = [None] * n_linear
        self._states: list[list[Tensor] | None] = [None] * n_linear

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, n: int) -> None:
        self.kv.length = n

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def reserve(self, s: int) -> tuple[int, int]:
        start, end = self.kv.reserve(s)
        self._start = start
        return start, end

    def record(self, i: int, inputs: Tensor, states: list[Tensor], every: bool) -> None:
        """Linear layer i's pass: its convolution inputs and the states before/after each position (`every`; else
        only the last: a long prompt's pass keeps no per-position states, it is never rolled back into)"""
        self._inputs[i], self._states[i] = inputs, (states if every else None)
        self.conv[i] = inputs[inputs.shape[0] - self.window:]
        self.state[i] = states[-1]

    def rollback(self, length: int) -> None:
        """Back to the state after token length-1 (0: empty)."""
        if length == self.length:
            return
        if not 0 <= length <= self.length:
            raise SpeculantError(f"cannot roll a cache of {self.length} tokens forward to {length}")
        if length == 0:
            for i in range(len(self.conv)):
                self.conv[i] = torch.zeros_like(self.conv[i])
                self.state[i] = torch.zeros_like(self.state[i])
        elif length >= self._start and all(s is not None for s in self._states):
            j = length - self._start  # positions of the last pass kept
            for i, (inputs, states) in enumerate(zip(self._inputs, self._states)):
                self.conv[i] = inputs[j : j + self.window]
                self.state[i] = states[j]
        else:
            raise SpeculantError(f"a recurrent state rolls back within its last pass only (to {self._start}.."
                                 f"{self.length} or 0), not to {length}")
        self.kv.rollback(length)
        # what is kept now: the restored state alone (a second rollback to it is a no-op)
        self._start = length
        self._inputs = list(self.conv)
        self._states = [[s] for s in self.state]

    def keep(self, base: int, indices: Tensor) -> None:
        raise SpeculantError("draft trees need each node's recurrent state; on a model with linear-attention layers "
                             "(Qwen3.5) speculant verifies chains only: choose a chain method")

    def snapshot(self) -> dict[str, Tensor]:
        """Every committed value (tests compare caches with it): the keys/values up to length, windows, states."""
        n = self.length
        out = {"k": self.kv.k[:, :, :n].clone(), "v": self.kv.v[:, :, :n].clone()}
        for i, (c, s) in enumerate(zip(self.conv, self.state)):
            out[f"conv.{i}"], out[f"state.{i}"] = c.clone(), s.clone()
        return out
