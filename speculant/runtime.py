"""Process-level runtime settings: CPU threading.

Batch-1 decoding is memory-bound and made of many small ops; one intra-op thread per physical
core and a single inter-op thread avoid the oversubscription that makes every OpenMP region wait
a scheduler tick on a small machine.
"""

from __future__ import annotations

import os

import torch

from .errors import SpeculantError


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads counted once)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        return max(1, (os.cpu_count() or 2) // 2)
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo") as f:
            cpu, phys = None, "0"
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "processor":
                    cpu = int(val)
                elif key == "physical id":
                    phys = val
                elif key == "core id" and cpu in allowed:
                    cores.add((phys, val))
    except OSError:
        pass
    return max(1, min(len(cores) or len(allowed), len(allowed)))


def configure_threads(threads: int | None = None) -> int:
    """Set torch's thread pools; `threads` or $SPECULANT_THREADS or one per physical core."""
    env = os.environ.get("SPECULANT_THREADS")
    if threads is None and env:
        try:
            threads = int(env)
        except ValueError:
            raise SpeculantError(f"SPECULANT_THREADS must be an integer, got {env!r}") from None
    n = threads or physical_cores()
    if n < 1:
        raise SpeculantError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or inter-op work already started): keep what is there
        pass
    return n
