"""`speculant serve` against the real `openai` client: completions and chat, streaming and not, stop
strings, seeded sampling, greedy output equal to `speculant generate`, every error class, a client
that leaves mid-stream, the per-request time limit and SIGTERM. SmolLM2-135M drafts for itself."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import httpx
import openai
import pytest

from server_util import MODEL, Server

pytestmark = pytest.mark.real
KEY = "test-key"
SPEC = ["--draft", MODEL, "--method", "hybrid"]
CHAT = [{"role": "user", "content": "List five fruits, one per line."}]


@pytest.fixture(scope="module")
def server():
    s = Server(*SPEC, "--api-key", KEY, "--max-queue", "1", "--max-body", "65536")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def cli_generate(capsys, *args: str) -> str:
    """`speculant generate` (its main(), in this process: a child would spend its time importing torch)."""
    from speculant.cli import main

    capsys.readouterr()
    assert main(["generate", "--model", MODEL, *SPEC, "--no-progress", "--threads", "1", *args]) == 0
    out = capsys.readouterr()
    return out.out[:-1]  # generate ends its output with a newline


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["method"] == "hybrid"


def test_chat_greedy_equals_cli_generate_and_streaming(client, capsys):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    text = r.choices[0].message.content
    assert text == cli_generate(capsys, "--chat", "-n", "40", CHAT[0]["content"])
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = r.model_extra["speculant"]
    assert ext["method"] == "hybrid" and 0 < ext["acceptance_rate"] <= 1 and ext["mean_accepted_tokens"] > 1
    # Streamed: the same text, the role first, usage last; each chunk says which of its characters were drafted.
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    exts = [c.model_extra["speculant"] for c in chunks if c.choices and c.choices[0].delta.content]
    assert sum(e["drafted"] for e in exts) > 0 and all(e["drafted"] <= e["proposed"] for e in exts)
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    # The second identical request reused the prefill of the first (all but the last message's pass).
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    # Every method (the `method` extension field) gives the same greedy text.
    for method in ("ar", "lookup", "draft"):
        other = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                               extra_body={"method": method})
        assert other.choices[0].message.content == text and other.model_extra["speculant"]["method"] == method


def test_completion_greedy_equals_cli_generate(client, capsys):
    prompt = "def fibonacci(n):\n"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0)
    assert r.choices[0].text == cli_generate(capsys, "-n", "48", prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True))
    assert streamed == r.choices[0].text


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0).choices[0].text
    assert " 7" in full
    for stop in (" 7", [" 7", "zzz"]):
        r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=stop)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(" 7")]


def test_seeded_sampling_repeats(client):
    def run(seed):
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=1.0, top_p=0.95,
                                              seed=seed, extra_body={"top_k": 50}).choices[0].message.content
    a = run(7)
    assert run(7) == a
    assert run(8) != a or run(9) != a


def error_of(call):
    with pytest.raises(openai.APIStatusError) as e:
        call()
    body = e.value.body
    assert set(body) >= {"message", "type", "param", "code"}, body  # openai unwraps {"error": {...}}
    return e.value.status_code, body


ERROR_TABLE: list[tuple[str, int, str]] = []


def test_error_classes(server, client):
    def raw(body: str | bytes, key: str = KEY):
        return httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})

    chat = client.chat.completions.create
    cases = {
        "malformed JSON": lambda: raw(b'{"model": '),
        "missing field": lambda: raw(json.dumps({"model": MODEL})),
        "mistyped field": lambda: raw(json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": "ten"})),
        "out of range": lambda: error_of(lambda: chat(model=MODEL, messages=CHAT, temperature=3.5)),
        "unknown field": lambda: raw(json.dumps({"model": MODEL, "messages": CHAT, "mirostat": 2})),
        "unknown method": lambda: raw(json.dumps({"model": MODEL, "messages": CHAT, "method": "medusa"})),
        "n > 1": lambda: error_of(lambda: chat(model=MODEL, messages=CHAT, n=2)),
        "tools": lambda: error_of(lambda: chat(model=MODEL, messages=CHAT, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])),
        "logprobs": lambda: error_of(lambda: chat(model=MODEL, messages=CHAT, logprobs=True)),
        "prompt too long": lambda: error_of(lambda: client.completions.create(model=MODEL, prompt="hi " * 9000)),
        "prompt + max_tokens too long": lambda: error_of(lambda: chat(model=MODEL, messages=CHAT, max_tokens=9000)),
        "unknown model": lambda: error_of(lambda: chat(model="gpt-4o", messages=CHAT)),
        "body too large": lambda: raw(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]})),
        "missing key": lambda: httpx.get(server.url + "/v1/models"),
        "wrong key": lambda: raw(json.dumps({"model": MODEL, "messages": CHAT}), key="nope"),
    }
    expect = {"malformed JSON": 400, "missing field": 400, "mistyped field": 400, "out of range": 400,
              "unknown field": 400, "unknown method": 400, "n > 1": 400, "tools": 400, "logprobs": 400, "prompt too long": 400,
              "prompt + max_tokens too long": 400, "unknown model": 404, "body too large": 413, "missing key": 401,
              "wrong key": 401}
    names = {"mistyped field": "max_tokens", "out of range": "temperature", "unknown field": "mirostat", "unknown method": "medusa", "n > 1": "n",
             "tools": "tools", "logprobs": "logprobs", "unknown model": "gpt-4o"}
    for case, call in cases.items():
        got = call()
        if isinstance(got, httpx.Response):
            got = (got.status_code, got.json()["error"])
        status, err = got
        assert status == expect[case], (case, status, err)
        assert err["message"] and err["type"], (case, err)
        if case in names:
            assert names[case] in err["message"], (case, err)
        ERROR_TABLE.append((case, status, err["message"]))
    long_msg = next(m for c, _, m in ERROR_TABLE if c == "prompt too long")
    counts = [int(n) for n in re.findall(r"\d+", long_msg)]
    assert 8192 in counts and max(counts) > 8192, long_msg  # the counts: the context and the prompt's tokens
    # The sampling fields (issue 16) are accepted, and their bad values are 400s naming them.
    extra = {"min_p": 0.05, "repeat_penalty": 1.2, "repeat_last_n": 32}
    r = chat(model=MODEL, messages=CHAT, max_tokens=4, presence_penalty=0.5, frequency_penalty=0.5,
             logit_bias={"42": 5}, extra_body=extra)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
    for case, body, field in (("bad logit_bias id", {"logit_bias": {"999999": 1}}, "logit_bias"),
                              ("bad repeat_penalty", {"repeat_penalty": 0}, "repeat_penalty")):
        got = raw(json.dumps({"model": MODEL, "messages": CHAT, **body}))
        err = got.json()["error"]
        assert got.status_code == 400 and err["param"] == field and field in err["message"], (case, err)
        ERROR_TABLE.append((case, got.status_code, err["message"]))
    print("\n| case | status | message |\n|---|---|---|")
    for case, status, message in ERROR_TABLE:
        print(f"| {case} | {status} | {message} |")


def test_queue_full_and_client_that_leaves_frees_the_engine(server, client):
    """One long stream runs, one request waits (--max-queue 1), the third gets 429 with Retry-After.
    The streaming client then drops: the engine is free within a round and serves the waiting one."""
    headers = {"Authorization": f"Bearer {KEY}"}
    long_body = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 4000, "temperature": 0, "stream": True,
                 "stop": ["never"]}
    with httpx.Client(timeout=120) as h:
        with h.stream("POST", server.url + "/v1/completions", json=long_body, headers=headers) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            waiting: dict[str, object] = {}
            t = threading.Thread(target=lambda: waiting.update(r=client.completions.create(
                model=MODEL, prompt="Hello", max_tokens=5, temperature=0)))
            t.start()
            deadline = time.monotonic() + 30
            while httpx.get(server.url + "/health").json()["queue"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            status, err = error_of(lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=5))
            assert status == 429 and err["code"] == "queue_full"
            ERROR_TABLE.append(("queue full", status, err["message"]))
            r = h.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers=headers)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        left = time.monotonic()  # the stream is closed: the client left
        t.join(60)
        assert waiting["r"].choices[0].text  # the queued request ran once the engine was free
        health = httpx.get(server.url + "/health").json()
        assert not health["running"] and health["queue"] == 0
        assert time.monotonic() - left < 10
    metrics = httpx.get(server.url + "/metrics").text
    assert 'speculant_requests_total{endpoint="/v1/completions",status="429"}' in metrics
    generated = float(next(line.split()[1] for line in metrics.splitlines()
                           if line.startswith("speculant_completion_tokens_total")))
    assert generated < 2000  # the dropped stream stopped long before its 4000 tokens


def test_metrics_prometheus_text(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("speculant_requests_total", "speculant_time_to_first_token_seconds_bucket", "speculant_tokens_per_second",
                 "speculant_acceptance_rate", "speculant_queue_length", "speculant_prompt_tokens_total"):
        assert f"\n{name}" in "\n" + text, name
    assert float(next(line.split()[1] for line in text.splitlines() if line.startswith("speculant_acceptance_rate "))) > 0


def test_time_limit_and_sigterm():
    """A generation past --request-timeout ends with finish_reason length; SIGTERM lets the running
    stream finish, and the process exits with 0."""
    s = Server(*SPEC, "--request-timeout", "2", "--shutdown-grace", "5")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        t0 = time.monotonic()
        r = c.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4000, temperature=0, stop=["never"])
        assert time.monotonic() - t0 < 10
        assert r.choices[0].finish_reason == "length" and r.model_extra["speculant"]["stopped"] == "time_limit"
        assert 0 < r.usage.completion_tokens < 4000
        stream = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0,
                                      stream=True)
        first = next(iter(stream))
        os.kill(s.server_pid(), 15)
        rest = list(stream)  # the running generation finishes within the grace period
        assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason in ("stop", "length")
        assert s.proc.wait(30) == 0
    finally:
        s.stop()
