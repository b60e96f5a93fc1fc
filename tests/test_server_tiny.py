"""The server's sampling fields and its queue time limit, on tiny random models (no real model needed).

The app runs in-process under uvicorn on a free loopback port and is driven by the real `openai`
client and raw HTTP. Sampling fields (OpenAI's presence_penalty, frequency_penalty, logit_bias, seed;
the extensions top_k, min_p, repeat_penalty, repeat_last_n) give exactly the tokens of the Python API
with the same SamplingConfig; invalid values are 400s naming the field; a request that waits in the
queue past its time limit is a 503 with Retry-After (streaming: an error event, then [DONE]).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from conftest import tiny_model
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig
from speculant.exact.sampler import SamplingConfig
from speculant.server.app import ServerConfig, create_app
from speculant.server.worker import Job

VOCAB = 48
MODEL = "tiny"
TEMPLATE = "{% for m in messages %}t7 t2 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t7 t2{% endif %}"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
# Every new field at once, with values that change the output (checked below).
FIELDS = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {"36": 2.0, "25": -100},
          "min_p": 0.05, "repeat_penalty": 1.3, "repeat_last_n": 4, "top_k": 20}


def make_engine(method: str = "hybrid", context: int = 1024) -> Engine:
    target = tiny_model(VOCAB, seed=1, logit_scale=3.0, context=context)
    draft = tiny_model(VOCAB, seed=2, logit_scale=3.0, dim=16, layers=1, context=context)
    target.tokenizer.chat_template = TEMPLATE
    return Engine(target, draft, MethodConfig(method), threads=1)


@contextmanager
def serving(engine: Engine, **cfg: object):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(engine, ServerConfig(MODEL, **cfg))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def api_config(temperature: float, seed: int | None, **fields: object) -> SamplingConfig:
    """The Python API's config for the same request fields."""
    bias = fields.pop("logit_bias", {})
    return SamplingConfig(temperature, top_p=fields.pop("top_p", 1.0), seed=seed, logit_bias=bias, **fields)


@pytest.mark.parametrize("method", ["hybrid", "ar"])
def test_sampling_fields_give_the_python_api_tokens(engine, client, method):
    """Seeded sampling and greedy with every new field: the server's text equals the engine's with the
    same SamplingConfig (the tiny tokenizer maps each token to one word, so equal text is equal tokens)."""
    e = engine.with_method(method)
    for temperature, seed in ((0.9, 3), (0.9, 4), (0.0, None)):
        sampling = api_config(temperature, seed, **FIELDS, top_p=0.95)
        want = e.generate(PROMPT, GenerationConfig(40, sampling))
        assert "t25" not in want.text.split()  # logit_bias -100 bans it in practice
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=temperature, top_p=0.95,
                                      seed=seed, presence_penalty=FIELDS["presence_penalty"],
                                      frequency_penalty=FIELDS["frequency_penalty"], logit_bias=FIELDS["logit_bias"],
                                      extra_body={k: FIELDS[k] for k in ("min_p", "repeat_penalty", "repeat_last_n", "top_k")}
                                      | {"method": method})
        assert r.choices[0].text == want.text, (method, temperature, seed)
        assert r.usage.completion_tokens == len(want.token_ids) == 40
        assert r.model_extra["speculant"]["method"] == method
        # The fields matter: without them the same seed gives other tokens.
        plain = e.generate(PROMPT, GenerationConfig(40, SamplingConfig(temperature, top_p=0.95, seed=seed)))
        assert plain.text != want.text
    # Chat, streamed: the same as the Python API's chat prompt.
    sampling = api_config(0.8, 11, **FIELDS)
    want = e.generate("t4 t4 t6", GenerationConfig(30, sampling), chat=True)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "t4 t4 t6"}], max_tokens=30, temperature=0.8, seed=11,
        stream=True, presence_penalty=0.7, frequency_penalty=0.4, logit_bias=FIELDS["logit_bias"],
        extra_body={"min_p": 0.05, "repeat_penalty": 1.3, "repeat_last_n": 4, "top_k": 20, "method": method})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def test_each_sampling_field_alone_matches(engine, client):
    """One field at a time (so that no field is silently dropped while the others carry the change);
    repeat_last_n with a repeat penalty, against the same penalty over the default window."""
    for name, value in FIELDS.items():
        others = {"repeat_penalty": 1.5} if name == "repeat_last_n" else {}
        want = engine.generate(PROMPT, GenerationConfig(24, api_config(1.0, 5, **others, **{name: value})))
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=5,
                                      extra_body={**others, name: value})
        assert r.choices[0].text == want.text, name
        # the field matters: it changes the text for at least one of four seeds (for seed 5 alone,
        # presence_penalty left the tiny model's text unchanged on an AVX2-only CPU)
        assert any(engine.generate(PROMPT, GenerationConfig(24, api_config(1.0, s, **others, **{name: value}))).text
                   != engine.generate(PROMPT, GenerationConfig(24, api_config(1.0, s, **others))).text
                   for s in range(5, 9)), name


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", "0.5"), ("frequency_penalty", -3), ("frequency_penalty", True),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"-4": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"5": "1"}),
    ("logit_bias", {"4800": 1}), ("logit_bias", [[5, 1]]), ("logit_bias", {str(i): 1 for i in range(1100)}),
    ("min_p", 1.5), ("min_p", -0.1), ("repeat_penalty", 0), ("repeat_penalty", -1.0), ("repeat_penalty", "1.1"),
    ("repeat_last_n", -2), ("repeat_last_n", 1.5), ("top_k", -1), ("top_p", 0), ("temperature", 1e-9),
    ("temperature", 2.5), ("seed", 1 << 64), ("seed", 1.5),
])
def test_invalid_sampling_values_are_400_naming_the_field(server, field, value):
    r = post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, field: value})
    assert r.status_code == 400, (field, value, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"].split(".")[0] == field and field in err["message"], err


def test_non_finite_numbers_are_400_naming_the_field(server):
    """Python's json reads NaN and Infinity; the server refuses them by name."""
    for field, literal in (("repeat_penalty", "Infinity"), ("presence_penalty", "NaN"), ("min_p", "NaN"),
                           ("temperature", "-Infinity")):
        body = '{"model": "%s", "prompt": "t3 t4", "%s": %s}' % (MODEL, field, literal)
        r = httpx.post(server + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_unavailable_methods_are_400(server, client):
    """Head methods need heads the server did not load: not offered (and not a 500)."""
    offered = client.models.list().data[0].model_extra["methods"]
    assert "medusa" not in offered and {"ar", "lookup", "draft", "hybrid"} <= set(offered)
    for method in ("medusa", "eagle3", "nope"):
        r = post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "method": method})
        assert r.status_code == 400 and r.json()["error"]["param"] == "method" and method in r.json()["error"]["message"]


def block_the_engine(app) -> Job:
    """A long generation submitted straight to the worker, with no deadline: it holds the engine until
    the test cancels it (the HTTP requests all get the server's short time limit)."""
    worker = app.state.worker
    long = worker.engine.target.config.context_length - len(PROMPT)  # tens of seconds on the tiny model
    job = Job(PROMPT, GenerationConfig(long, SamplingConfig(), ignore_eos=True), worker.engine,
              asyncio.new_event_loop(), math.inf)  # nobody reads its events: posting to an idle loop is harmless
    worker.submit(job)
    deadline = time.monotonic() + 30
    while worker.running is not job:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return job


def test_request_that_waits_past_its_time_limit_gets_503():
    timeout = 1.5
    with serving(make_engine("ar", context=1 << 16), request_timeout=timeout) as (url, app):
        blocker = block_the_engine(app)
        try:
            t0 = time.monotonic()
            r = post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 8})
            waited = time.monotonic() - t0
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "queue_timeout" and err["type"] == "server_error" and "retry" in err["message"]
            assert int(r.headers["retry-after"]) >= 1
            assert timeout <= waited < timeout + 5  # answered at its deadline, not when the engine got free
            assert app.state.worker.running is blocker
            # Streamed: the 200 is already sent; an error event in OpenAI's shape, then [DONE].
            events = []
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
                    "model": MODEL, "messages": [{"role": "user", "content": "t3"}], "max_tokens": 8, "stream": True}) as s:
                assert s.status_code == 200
                events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "queue_timeout" and set(error) == {"message", "type", "param", "code"}
            assert all("choices" in json.loads(e) and not any(c["delta"].get("content") for c in json.loads(e)["choices"])
                       for e in events[:-2])  # only the role chunk came before: no text, no finish_reason
            # The openai client raises it as an error.
            c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
            with pytest.raises(openai.APIError, match="waited"):
                list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True))
            assert app.state.worker.running is blocker  # (so each request above waited behind it)
        finally:
            blocker.cancelled.set()
        # The engine is free again: a request gets served within its limit, from the start.
        deadline = time.monotonic() + 30
        while app.state.worker.running is not None or app.state.worker.waiting:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert r.json()["choices"][0]["text"] == make_engine("ar").generate(PROMPT, GenerationConfig(8)).text


def test_python_api_refuses_what_the_server_refuses():
    """The same bad values through SamplingConfig: a SpeculantError naming the setting (a seed past what
    torch.Generator takes was a raw ValueError from inside torch at the first draw)."""
    from speculant.errors import SpeculantError

    for kw, name in (({"seed": 1 << 64}, "seed"), ({"seed": -(1 << 63) - 1}, "seed"), ({"temperature": 1e-9}, "temperature"),
                     ({"repeat_penalty": 0.0}, "repeat penalty"), ({"repeat_last_n": -2}, "repeat-last-n"),
                     ({"min_p": 1.5}, "min-p"), ({"top_k": -1}, "top-k"), ({"logit_bias": {"x": 1}}, "logit bias")):
        with pytest.raises(SpeculantError, match=name):
            SamplingConfig(**kw)
    SamplingConfig(seed=(1 << 64) - 1).generator()  # the bounds themselves are fine
    SamplingConfig(seed=-(1 << 63)).generator()


def test_clients_taking_turns_keep_their_prompt_caches(prefill_route):
    """Two chats taking turns through the server: with two prompt cache slots each turn's prompt is served
    from its own chat's cache (the last prompt and answer: usage's cached_tokens), with one they evict each
    other. A tiny q8_0 target on the fused route, where the answers are reused too."""
    from speculant.errors import SpeculantError

    prefill_route("fused")
    target = tiny_model(VOCAB, seed=1, fmt="q8_0", dim=64, heads=2, kv_heads=1, logit_scale=3.0, context=1024)
    if not target.model.batch_invariant_prompts():
        pytest.skip("the fused blocks need the x86 kernels")
    target.tokenizer.chat_template = TEMPLATE
    engine = Engine(target, method=MethodConfig("ar"), threads=1)
    with pytest.raises(SpeculantError, match="slots"):
        ServerConfig(MODEL, prompt_cache_slots=0)

    def chats(slots: int) -> list[int]:
        cached = []
        with serving(engine, prompt_cache_slots=slots) as (url, _):
            c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            talks = {"a": [], "b": []}
            for who, text in (("a", "t3 t4 t5"), ("b", "t9 t8"), ("a", "t6"), ("b", "t1 t2"), ("a", "t11")):
                talks[who].append({"role": "user", "content": text})
                r = c.chat.completions.create(model=MODEL, messages=talks[who], max_tokens=6, temperature=0)
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
                talks[who].append({"role": "assistant", "content": r.choices[0].message.content})
        return cached

    two, one = chats(2), chats(1)
    assert two[:2] == [0, 0] and min(two[2:]) > 8  # at least the chat's first prompt (5) and answer (6) but one
    assert max(one[2:]) < 3  # the other chat's prompt starts alike ("t7 t2") and nothing more
