"""Process-level runtime settings: CPU threading.

Batch-1 decoding is memory-bound and made of many small ops; one intra-op thread per physical
core and a single inter-op thread avoid the oversubscription that makes every OpenMP region wait
a scheduler tick on a small machine. In a container the CPU quota (cgroup `cpu.max`) bounds the
default too: 16 visible cores with a 2-CPU quota get 2 threads, not 16 that the kernel throttles.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from .errors import SpeculantError

_CGROUP_ROOT = Path("/sys/fs/cgroup")


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


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def cpu_quota(root: Path = _CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs this process may use per period under its cgroup's quota, or None when unlimited.

    cgroup v2: `cpu.max` ("max 100000" or "<quota> <period>") of this process's group and of every
    ancestor (the tightest wins); cgroup v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` of the cpu
    controller's group. Unreadable or malformed files count as no limit.
    """
    groups: list[tuple[Path, str]] = []  # (group folder, "v2" | "v1")
    for line in (_read(proc_cgroup) or "").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        rel = rel.lstrip("/")
        if hier == "0" and controllers == "":
            folder = root / rel
            while True:  # the group and its ancestors up to the root
                groups.append((folder, "v2"))
                if folder == root or root not in folder.parents:
                    break
                folder = folder.parent
        elif "cpu" in controllers.split(","):
            for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                if (root / name).is_dir():
                    groups += [(root / name / rel, "v1"), (root / name, "v1")]
                    break
    limits = []
    for folder, kind in groups:
        if kind == "v2":
            quota, _, period = (_read(folder / "cpu.max") or "max").partition(" ")
        else:
            quota, period = _read(folder / "cpu.cfs_quota_us") or "-1", _read(folder / "cpu.cfs_period_us") or ""
        try:
            q, p = int(quota), int(period)
        except ValueError:  # "max" or missing: no limit at this level
            continue
        if q > 0 and p > 0:
            limits.append(q / p)
    return min(limits) if limits else None


def default_threads() -> int:
    """One thread per physical core, at most the container's CPU quota (rounded up)."""
    n = physical_cores()
    quota = cpu_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return n


def configure_threads(threads: int | None = None) -> int:
    """Set torch's thread pools to `threads`, else $SPECULANT_THREADS, else `default_threads()`; return it."""
    source = "--threads"
    env = os.environ.get("SPECULANT_THREADS", "").strip()
    if threads is None and env:
        source = "SPECULANT_THREADS"
        try:
            threads = int(env)
        except ValueError:
            raise SpeculantError(f"SPECULANT_THREADS must be a whole number >= 1, got {env!r}") from None
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise SpeculantError(f"{source} must be a whole number >= 1 (leave it unset for one thread per "
                             f"physical core), got {threads!r}")
    n = threads if threads is not None else default_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or inter-op work already started): keep what is there
        pass
    return n
