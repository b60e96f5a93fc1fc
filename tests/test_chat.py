"""`speculant chat`'s turns (speculant.chat.Conversation, what the REPL calls): the prompt cache spares
re-prefilling the history, and a context overflow or Ctrl-C ends that answer, not the conversation."""

import pytest

from conftest import tiny_model
from speculant.chat import Conversation
from speculant.engine import Engine, GenerationConfig, MethodConfig

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
