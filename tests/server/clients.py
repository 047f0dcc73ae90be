"""Checks `diskformer serve` with the official `openai` and `anthropic` Python clients.

Plain Python (no pytest): each check raises on failure; the script exits non-zero when one fails.
Usage: clients.py BASE_URL MODEL
"""
import json
import sys
import urllib.request

import anthropic
import openai

BASE, MODEL = sys.argv[1], sys.argv[2]
oa = openai.OpenAI(base_url=BASE + "/v1", api_key="test-key", max_retries=0)
an = anthropic.Anthropic(base_url=BASE, api_key="test-key", max_retries=0)
failures = []


def check(name):
    def wrap(f):
        try:
            f()
            print(f"ok   {name}")
        except Exception as e:  # noqa: BLE001 - report every failure, then exit non-zero
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            failures.append(name)
        return f
    return wrap


def raw_post(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer test-key"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


MSG = [{"role": "user", "content": "Say hello."}]


@check("openai models list")
def _():
    ids = [m.id for m in oa.models.list()]
    assert MODEL in ids, ids


@check("openai chat")
def _():
    r = oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, temperature=0, seed=1)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length")


@check("openai chat streaming")
def _():
    s = oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, temperature=0, stream=True,
                                   stream_options={"include_usage": True})
    chunks = list(s)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1, finishes
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5


@check("openai completions")
def _():
    r = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"


@check("openai tools are accepted and rendered")
def _():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0, tools=tools)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@check("openai error envelope (unknown field)")
def _():
    try:
        oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body={"frobnicate": 1})
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert "frobnicate" in str(e.body), e.body
        return
    raise AssertionError("no error")


@check("openai embeddings on a generative model is a clear 400")
def _():
    try:
        oa.embeddings.create(model=MODEL, input="hello")
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert "pooling_type" in str(e.body), e.body
        return
    raise AssertionError("no error")


@check("openai unknown model is 404")
def _():
    try:
        oa.chat.completions.create(model="no-such-model", messages=MSG, max_tokens=2)
    except openai.NotFoundError:
        return
    raise AssertionError("no error")


@check("token counting and deferred tools (openai form)")
def _():
    def tool(name, defer):
        return {"type": "function", "defer_loading": defer,
                "function": {"name": name, "description": "does " + name, "parameters": {"type": "object"}}}
    base = raw_post("/v1/chat/completions/input_tokens", {"model": MODEL, "messages": MSG, "tools": [tool("a", False)]})
    deferred = raw_post("/v1/chat/completions/input_tokens",
                        {"model": MODEL, "messages": MSG, "tools": [tool("a", False), tool("b", True)]})
    both = raw_post("/v1/chat/completions/input_tokens",
                    {"model": MODEL, "messages": MSG, "tools": [tool("a", False), tool("b", False)]})
    assert base["input_tokens"] == deferred["input_tokens"] < both["input_tokens"], (base, deferred, both)


@check("anthropic messages")
def _():
    r = an.messages.create(model=MODEL, max_tokens=4, messages=MSG, system="Be brief.", extra_body={"temperature": 0})
    assert r.role == "assistant" and r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.output_tokens <= 4


@check("anthropic streaming")
def _():
    with an.messages.stream(model=MODEL, max_tokens=4, messages=MSG, extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert "".join(b.text for b in final.content if b.type == "text") == text


@check("anthropic count_tokens and deferred tools, tool_result with tool_reference")
def _():
    def tool(name, defer):
        t = {"name": name, "description": "does " + name, "input_schema": {"type": "object"}}
        if defer:
            t["defer_loading"] = True
        return t
    n0 = an.messages.count_tokens(model=MODEL, messages=MSG, tools=[tool("a", False)]).input_tokens
    n1 = an.messages.count_tokens(model=MODEL, messages=MSG, tools=[tool("a", False), tool("b", True)]).input_tokens
    assert n0 == n1, (n0, n1)
    conv = MSG + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "a", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "done"},
                                                  {"type": "tool_reference", "tool_name": "b"}]}]},
    ]
    m = an.messages.count_tokens(model=MODEL, messages=conv, tools=[tool("a", False), tool("b", True)]).input_tokens
    m_all = an.messages.count_tokens(model=MODEL, messages=conv, tools=[tool("a", False), tool("b", False)]).input_tokens
    assert m == m_all, (m, m_all)
    r = an.messages.create(model=MODEL, max_tokens=3, messages=conv, tools=[tool("a", False), tool("b", True)])
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")


@check("anthropic error envelope")
def _():
    try:
        an.messages.create(model=MODEL, max_tokens=2, messages=MSG, extra_body={"bogus": 1})
    except anthropic.BadRequestError as e:
        assert e.body["type"] == "error", e.body
        return
    raise AssertionError("no error")


@check("api key is required")
def _():
    bad = openai.OpenAI(base_url=BASE + "/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
    except openai.AuthenticationError:
        return
    raise AssertionError("no error")


if failures:
    print(f"{len(failures)} check(s) failed: {', '.join(failures)}")
    sys.exit(1)
print("all client checks passed")
