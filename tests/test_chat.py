"""`speculant chat`'s turns (speculant.chat.Conversation, what the REPL calls): the prompt cache spares
re-prefilling the history, and a context overflow or Ctrl-C ends that answer, not the conversation."""

import pytest

from conftest import tiny_model
from speculant.chat import Conversation
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig

TEMPLATE = ("{% for m in messages %}t7 t2 {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}t7 t2{% endif %}")


@pytest.fixture(scope="module")
def engine():
    target = tiny_model(32, seed=1, logit_scale=3.0, eos=7, context=96)
    draft = tiny_model(32, seed=2, logit_scale=3.0, dim=16, layers=1, eos=7, context=96)
    target.tokenizer.chat_template = TEMPLATE
    return Engine(target, draft, MethodConfig("hybrid"))


def test_turns_reuse_the_history_prefill(engine):
    chat = Conversation(engine, GenerationConfig(max_new_tokens=8, ignore_eos=True), system="t9 t9")
    shown: list[str] = []
    turns = [chat.turn(text, shown.append) for text in ("t3 t4 t5", "t6 t5", "t3 t3 t4")]
    assert all(t.finish == "length" and t.reply for t in turns)
    assert "".join(shown) == "".join(t.reply for t in turns)
    assert turns[0].stats.cached_prompt_tokens == 0
    # Turn n reuses the previous prompt but its last message start (the assistant header "t7 t2"),
    # which is prefilled again with the answer.
    for prev, t in zip(turns, turns[1:]):
        if not prev.reply.startswith("t7"):
            assert t.stats.cached_prompt_tokens == prev.stats.prompt_tokens - 2
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * 3


def test_overflow_ends_the_answer_not_the_conversation(engine):
    chat = Conversation(engine, GenerationConfig(max_new_tokens=200, ignore_eos=True))
    cut = chat.turn("t3 t4", lambda s: None)
    assert cut.finish == "length" and 0 < cut.stats.generated_tokens < 200  # the context (96) filled up
    over = chat.turn("t5 t6", lambda s: None)  # the history no longer fits: this message is refused
    assert over.finish == "error" and "context" in over.error and "/reset" in over.error
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]  # the refused message is not kept
    chat.reset()
    assert chat.turn("t5 t6", lambda s: None).finish == "length"
    too_long = chat.turn(" ".join(["t3"] * 120), lambda s: None)
    assert too_long.finish == "error" and "context" in too_long.error


def test_ctrl_c_ends_the_answer_not_the_conversation(engine):
    chat = Conversation(engine, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    shown: list[str] = []

    def write(text: str) -> None:  # Ctrl-C arrives while the third piece of the answer is shown
        shown.append(text)
        if len(shown) == 3:
            raise KeyboardInterrupt

    stopped = chat.turn("t3 t4 t5", write)
    assert stopped.finish == "interrupted" and stopped.reply == "".join(shown) and stopped.reply
    assert chat.messages[-1] == {"role": "assistant", "content": stopped.reply}
    after = chat.turn("t6", lambda s: None)  # the conversation goes on from the cut answer
    assert after.finish == "length" and after.stats.generated_tokens == 40
    assert after.stats.cached_prompt_tokens > 0
    # And its answer is the one a fresh engine gives for the same history.
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(chat.messages[:-1]), add_special=False)
    assert engine.generate(ids, chat.gen).text == after.reply


@pytest.mark.real
def test_cli_chat_survives_ctrl_c_in_a_pty():
    """The real REPL on a pseudo-terminal: SIGINT (what Ctrl-C sends) during an answer stops that
    answer; the next message is answered; an empty line quits with status 0."""
    import os
    import pty
    import select
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    master, slave = pty.openpty()
    env = {**os.environ, "SPECULANT_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "speculant.cli", "chat", "--model", "smollm2-135m-instruct",
                             "--no-progress", "--max-tokens", "600"], stdin=slave, stdout=slave, stderr=slave,
                            cwd=Path(__file__).resolve().parent.parent, env=env,
                            # as from a terminal: a test run started in the background (`cmd &` in a script) ignores
                            # SIGINT, the child would inherit that, and Python then installs no Ctrl-C handler
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    seen = ""

    def read_until(needle: str, timeout: float = 120.0, start: int = 0) -> int:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while needle not in seen[start:]:
            assert time.monotonic() < deadline, f"no {needle!r} in {seen[-2000:]!r}"
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 4096).decode(errors="replace")
                except OSError:
                    break
        return seen.index(needle, start) + len(needle)

    try:
        at = read_until("> ")
        os.write(master, b"Write a very long story about a dragon who learns to cook.\n")
        read_until(" ", start=at + 70)  # some of the answer has streamed (past the echoed message)
        proc.send_signal(signal.SIGINT)
        at = read_until("(answer interrupted)")
        at = read_until("> ", start=at)
        assert proc.poll() is None  # the conversation goes on
        os.write(master, b"Thanks. Now say goodbye in one short sentence.\n")
        at = read_until("> ", start=at + 10, timeout=180)
        os.write(master, b"\n")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
