"""Process-level runtime settings: CPU threading, and how many threads a decode runs with while other
processes share the CPUs (`ThreadShare`).

Batch-1 decoding is memory-bound and made of many small ops; one intra-op thread per physical
core and a single inter-op thread avoid the oversubscription that makes every OpenMP region wait
a scheduler tick on a small machine. In a container the CPU quota (cgroup `cpu.max`) bounds the
default too: 16 visible cores with a 2-CPU quota get 2 threads, not 16 that the kernel throttles.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
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


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU as the kernel names it, with its x86 family and model where given ("AMD EPYC (family 25,
    model 17)"), else what `platform` reports: benchmarks name the machine their numbers come from."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():  # the first processor's entry is enough
                    break
                key, _, val = line.partition(":")
                fields.setdefault(key.strip(), val.strip())
    except (OSError, UnicodeDecodeError):
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


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


def threads_fixed(threads: int | None) -> bool:
    """Whether the user fixed the thread count (`threads`, or $SPECULANT_THREADS): then it never moves."""
    return threads is not None or bool(os.environ.get("SPECULANT_THREADS", "").strip())


def busy_jiffies(cpus: frozenset[int], text: str | None) -> int | None:
    """Time the CPUs `cpus` spent busy since boot, in clock ticks, from /proc/stat's text (None: unreadable,
    or none of them listed). Busy is all but idle and iowait; steal counts as busy (the hypervisor gave the
    CPU to someone else, so it was not free for us); guest time is inside user time already."""
    if text is None:
        return None
    busy, seen = 0, False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        try:
            v = [int(x) for x in rest.split()[:8]]
        except ValueError:
            return None
        if len(v) < 5:
            return None
        busy += sum(v) - v[3] - v[4]
        seen = True
    return busy if seen else None


class ThreadShare:
    """Decoding threads that follow the CPUs other processes leave free.

    Every pass synchronizes its threads at each linear, and a thread the OS has set aside for another
    process stalls the others until it runs again: with a busy process beside it on 2 cores, the 1.5B
    decoded less than half as fast with 2 threads as with 1 (`bash scripts/shared_cores.sh`;
    docs/measurements.md "Cores shared with other processes"). So every `window` seconds of decoding
    (`tick()` after each round; a clock read otherwise) the CPU time other processes took on our CPUs
    (/proc/stat's busy ticks less this process's CPU time) sets the thread count for the next window:
    the CPUs left free, rounded, between 1 and `max_threads`. A token's logits are the same bits with any
    thread count (each output is summed by one thread; tests/test_threads.py), so the output never
    depends on it. Where /proc/stat cannot be read the count stays as it is.
    """

    def __init__(self, max_threads: int, window: float = 0.5, *, cpus: frozenset[int] | None = None,
                 stat: Callable[[], str | None] = lambda: _read(Path("/proc/stat")),
                 clock: Callable[[], float] = time.perf_counter, cpu_time: Callable[[], float] = time.process_time,
                 threads: tuple[Callable[[], int], Callable[[int], None]] = (torch.get_num_threads,
                                                                             torch.set_num_threads),
                 tick_hz: int | None = None) -> None:
        if cpus is None:
            cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        self.max_threads, self.window, self.cpus = max_threads, window, cpus
        self._stat, self._clock, self._cpu_time = stat, clock, cpu_time
        self._get, self._set = threads  # the process's thread count (torch's: other engines may move it too)
        self._hz = tick_hz or (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self._mark: tuple[float, float, int] | None = None  # (wall, our CPU time, busy ticks) at the window's start

    def start(self) -> None:
        """Begin a window now (a generation's decoding starts; time between generations is not counted)."""
        busy = busy_jiffies(self.cpus, self._stat())
        self._mark = None if busy is None else (self._clock(), self._cpu_time(), busy)

    def tick(self) -> None:
        if self._mark is None:
            return
        now = self._clock()
        wall = now - self._mark[0]
        if wall < self.window:
            return
        busy, ours = busy_jiffies(self.cpus, self._stat()), self._cpu_time()
        if busy is None:
            self._mark = None
            return
        others = max(0.0, (busy - self._mark[2]) / self._hz - (ours - self._mark[1])) / wall  # CPUs
        n = max(1, min(self.max_threads, round(len(self.cpus) - others)))
        if n != self._get():
            self._set(n)
        self._mark = (now, ours, busy)
