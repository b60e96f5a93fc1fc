"""A terminal conversation (`speculant chat`): the turn logic, apart from the REPL's input/output.

Every turn's prompt is the whole conversation through the chat template; the engine's prompt cache
reuses the earlier turns' prefill, so a turn costs its new messages, not the history. A turn that
overflows the context or is interrupted (Ctrl-C) ends that answer; the conversation goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .decoding.engine import Chunk, Done, Engine, GenerationConfig
from .errors import SpeculantError
from .decoding.stats import Stats


@dataclass(slots=True)
class Turn:
    reply: str
    finish: str  # "stop", "length" (max tokens or the context filled up), "interrupted" or "error"
    stats: Stats | None = None
    error: str | None = None


class Conversation:
    def __init__(self, engine: Engine, gen: GenerationConfig, system: str | None = None) -> None:
        if engine.tokenizer.chat_template is None:
            raise SpeculantError(f"{engine.target.name} has no chat template; use `speculant generate` instead")
        self.engine = engine
        self.gen = gen
        self.system = system
        self.cache = engine.prompt_cache()
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Start over (the prompt cache stays: a new conversation still shares the system prompt)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, text: str, write: Callable[[str], None]) -> Turn:
        """Answer one user message, streaming it through `write`."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.engine.encode_messages(self.messages)
        except SpeculantError as e:
            self.messages.pop()  # the message never got an answer: leave the history as it was
            hint = " (/reset starts a new conversation)" if len(self.messages) > 1 else ""
            return Turn("", "error", error=f"{e}{hint}")
        reply = ""
        done: Done | None = None
        stream = self.engine.stream(ids, self.gen, cache=self.cache)
        try:
            for ev in stream:
                if isinstance(ev, Chunk):
                    reply += ev.text
                    write(ev.text)
                else:
                    done = ev
        except KeyboardInterrupt:
            pass
        except SpeculantError as e:
            self.messages.append({"role": "assistant", "content": reply})
            return Turn(reply, "error", error=str(e))
        finally:
            stream.close()
        # What was shown is what the model said, cut or not: the next turn continues from it.
        self.messages.append({"role": "assistant", "content": reply})
        if done is None:
            return Turn(reply, "interrupted")
        return Turn(reply, done.finish_reason, done.stats)
