"""Threads that follow the CPUs other processes leave free (runtime.ThreadShare), and why that never
changes a token: the target's logits are the same bits with any thread count, in every format that
adapts (float32, whose matmul is not, keeps its count)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig
from speculant.threads import ThreadShare, busy_jiffies
from speculant.exact.sampler import SamplingConfig

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1, 5, 9, 2, 6]

STAT = """cpu  {t0} 0 0 0 0 0 0 0 0 0
cpu0 {a} 5 {a} 900 7 1 1 2 0 0
cpu1 {b} 0 {b} 800 3 0 0 0 0 0
cpu2 1000 0 1000 10 0 0 0 0 0 0
intr 12345
"""


def stat(a: int, b: int) -> str:
    return STAT.format(t0=a + b, a=a, b=b)


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_busy_ticks_of_our_cpus_from_proc_stat():
    # cpu0: user 10 + nice 5 + system 10 + irq 1 + softirq 1 + steal 2 (idle 900, iowait 7 left out)
    assert busy_jiffies(frozenset({0}), stat(10, 20)) == 29
    assert busy_jiffies(frozenset({0, 1}), stat(10, 20)) == 29 + 40
    assert busy_jiffies(frozenset({0, 1, 7}), stat(10, 20)) == 69  # CPUs not listed add nothing
    assert busy_jiffies(frozenset({7}), stat(10, 20)) is None
    assert busy_jiffies(frozenset({0}), None) is None
    assert busy_jiffies(frozenset({0}), "cpu0 1 2 x 4 5\n") is None  # malformed: no answer, not a guess


class Host:
    """A clock, this process's CPU time and /proc/stat, moved by hand: `run(wall, ours, others)` passes
    `wall` seconds in which this process used `ours` CPU-seconds and other processes `others`."""

    def __init__(self) -> None:
        self.wall, self.ours, self.ticks = 0.0, 0.0, 0
        self.threads = 2

    def run(self, wall: float, ours: float, others: float) -> None:
        self.wall += wall
        self.ours += ours
        self.ticks += round(100 * (ours + others))

    def share(self, max_threads: int = 2, readable: bool = True) -> ThreadShare:
        def text() -> str | None:
            return f"cpu0 {self.ticks} 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0\n" if readable else None

        return ThreadShare(max_threads, 0.5, cpus=frozenset({0, 1}), stat=text,
                           clock=lambda: self.wall, cpu_time=lambda: self.ours,
                           threads=(lambda: self.threads, self._set), tick_hz=100)

    def _set(self, n: int) -> None:
        self.threads = n


def test_threads_follow_the_cpus_other_processes_leave():
    host = Host()
    share = host.share()
    share.start()
    host.run(0.3, 0.6, 0.0)
    share.tick()
    assert host.threads == 2  # within the window: nothing read, nothing changed
    host.run(0.3, 0.4, 0.4)  # another process took 0.4 CPU-s of 0.6 s: 0.67 CPUs, 1.33 left
    share.tick()
    assert host.threads == 1
    host.run(0.6, 0.6, 0.6)  # it goes on with one CPU: still one left
    share.tick()
    assert host.threads == 1
    host.run(0.6, 0.6, 0.05)  # it stopped (a little background work remains)
    share.tick()
    assert host.threads == 2
    host.run(0.6, 1.2, 1.2)  # two busy processes beside us: never below one thread
    share.tick()
    assert host.threads == 1


def test_threads_stay_where_proc_stat_cannot_be_read():
    host = Host()
    share = host.share(readable=False)
    share.start()
    host.run(1.0, 0.5, 2.0)
    share.tick()
    assert host.threads == 2


def test_threads_never_exceed_the_engines_count():
    host = Host()
    host.threads = 1
    share = host.share(max_threads=1)
    share.start()
    host.run(1.0, 1.0, 0.0)  # a CPU free, but the user's count is 1
    share.tick()
    assert host.threads == 1


def test_fixed_or_float32_engines_do_not_adapt(monkeypatch, keep_threads, prefill_route):
    from speculant.models.formats import ggml

    monkeypatch.delenv("SPECULANT_THREADS", raising=False)
    prefill_route("rows")  # the integer kernels on any host (AMX puts bf16 first)
    assert Engine(tiny_model(16, fmt="q8_0", dim=64, hidden=128))._share is not None
    # oneDNN's bf16 route sums a long K over its threads: a block-format model whose prompts take it keeps its count
    monkeypatch.setattr(ggml, "prefill_routes", lambda: ("bf16", "rows"))
    bf16 = tiny_model(16, fmt="q8_0", dim=64, hidden=128)
    assert not bf16.model.lm_head.thread_invariant and not bf16.model.thread_invariant()
    assert Engine(bf16)._share is None
    monkeypatch.setattr(ggml, "prefill_routes", lambda: ("rows",))
    assert bf16.model.thread_invariant()
    assert Engine(tiny_model(16, fmt="q8_0", dim=64, hidden=128), threads=2)._share is None
    assert Engine(tiny_model(16, fmt="float32"))._share is None
    monkeypatch.setenv("SPECULANT_THREADS", "2")
    assert Engine(tiny_model(16, fmt="q8_0", dim=64, hidden=128))._share is None


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8", "bf16"])
def test_logits_are_the_same_bits_with_any_thread_count(fmt, keep_threads):
    """Prefill (past the row-wise limit), verification and decoding passes at 2, then 1 thread."""
    assert_same_bits_at_2_and_1_threads(tiny_model(64, seed=1, dim=64, hidden=128, fmt=fmt).model,
                                        torch.tensor([i * 7 % 64 for i in range(60)]), 50)


def assert_same_bits_at_2_and_1_threads(model, ids: torch.Tensor, prompt: int) -> None:
    """The logits of a prompt pass (its last 4 rows), a 5-token verification pass and a decoding pass."""
    runs = []
    for n in (2, 1):
        torch.set_num_threads(n)
        cache = model.new_cache(len(ids) + 8)
        runs.append([model(ids[:prompt], cache, logit_rows=slice(-4, None)).logits,
                     model(ids[prompt:prompt + 5], cache).logits, model(ids[prompt + 5:prompt + 6], cache).logits])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


class Flipping(ThreadShare):
    """Switches between 1 and 2 threads after every round: the most the thread count can move."""

    def __init__(self) -> None:
        super().__init__(2, cpus=frozenset({0, 1}))
        self.seen: set[int] = set()

    def start(self) -> None:
        pass

    def tick(self) -> None:
        torch.set_num_threads(3 - torch.get_num_threads())
        self.seen.add(torch.get_num_threads())


@pytest.mark.parametrize("method", ["ar", "draft", "lookup", "hybrid"])
def test_tokens_do_not_depend_on_thread_changes(method, keep_threads):
    target = tiny_model(64, seed=1, dim=64, hidden=128, fmt="q8_0", logit_scale=3.0)
    draft = tiny_model(64, seed=2, dim=64, hidden=128, layers=1, fmt="q8_0", logit_scale=3.0)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.95, seed=7)):
        gen = GenerationConfig(max_new_tokens=48, ignore_eos=True, sampling=sampling)
        fixed = Engine(target, draft if method in ("draft", "hybrid") else None, MethodConfig(method), threads=2)
        want = fixed.generate(PROMPT, gen).token_ids
        moving = Engine(target, draft if method in ("draft", "hybrid") else None, MethodConfig(method), threads=2)
        moving._share = Flipping()
        assert moving.generate(PROMPT, gen).token_ids == want
        assert moving._share.seen == {1, 2}


@pytest.mark.real
def test_real_model_logits_are_the_same_bits_with_any_thread_count(real_model_cache, keep_threads, prefill_route):
    """The file's own blocks as they run: repacked tiles, the fused block loop, the prompt route, at 2 then 1
    thread. Where AMX puts oneDNN's bf16 route first, its prompt bits change with the thread count (its down
    projections' K of 4864, split over threads): the model says so (the engine then keeps its count), and the
    integer prompt route is checked instead."""
    from speculant.bench.speed import bench_ids

    loaded = real_model_cache("qwen2.5-coder-0.5b-instruct", "gguf")
    model = loaded.model
    prefill_route(None)  # this CPU's own routes
    if model.lm_head._long_route() == "bf16":
        assert not model.thread_invariant()
        prefill_route("gemm")
    assert model.thread_invariant()
    assert_same_bits_at_2_and_1_threads(model, torch.tensor(bench_ids(loaded.tokenizer.encode, 200)), 190)
