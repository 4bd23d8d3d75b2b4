"""Drives a running Tandem router with the official `openai` Python package.

    python tests/python/openai_client.py --base-url http://127.0.0.1:8080/v1 --model smollm2

Exits non-zero (with an assertion message) when any response does not parse or lacks a
field the seeds define.
"""

import argparse
import json

import httpx
import openai


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=16, temperature=0
    )
    choice = chat.choices[0]
    assert chat.object == "chat.completion", chat
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content, chat
    assert choice.finish_reason in ("stop", "length"), choice
    usage = chat.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    extra = chat.model_extra
    assert len(usage.model_extra["batch_size"]) == usage.completion_tokens, usage
    assert len(extra["decode_time_arr"]) == usage.completion_tokens - 1, extra
    assert extra["prefill_time"] > 0, extra

    pieces, last = [], None
    for chunk in client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=16, temperature=0, stream=True
    ):
        assert chunk.object == "chat.completion.chunk", chunk
        pieces.append(chunk.choices[0].delta.content or "")
        last = chunk
    assert "".join(pieces) == choice.message.content, (pieces, choice.message.content)
    assert last.choices[0].finish_reason == choice.finish_reason
    assert last.usage.completion_tokens == usage.completion_tokens, last.usage

    # What current SDKs send: max_completion_tokens, stream_options.include_usage, user.
    chunks = list(client.chat.completions.create(
        model=args.model, messages=messages, max_completion_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True}, user="someone",
    ))
    *tokens, closing = chunks
    assert closing.choices == [], closing
    assert closing.usage.completion_tokens == usage.completion_tokens, closing.usage
    assert "".join(c.choices[0].delta.content or "" for c in tokens) == choice.message.content
    try:
        client.chat.completions.create(
            model=args.model, messages=messages, max_tokens=4, max_completion_tokens=5
        )
        raise AssertionError("two different token budgets must be refused")
    except openai.BadRequestError as e:
        assert e.body["param"] == "max_completion_tokens", e.body

    text = client.completions.create(
        model=args.model, prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert text.object == "text_completion", text
    assert isinstance(text.choices[0].text, str)
    assert text.usage.completion_tokens <= 8, text.usage

    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=args.model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
    )
    assert streamed == text.choices[0].text, (streamed, text.choices[0].text)

    lp = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens, lp
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content), content

    # logit_bias, and vLLM's min_p and min_tokens (sent as the SDK's extra_body).
    forced = [
        client.completions.create(
            model=args.model, prompt="Once upon a time", max_tokens=4, temperature=0,
            logprobs=0, logit_bias={str(token): 100},
        ).choices[0].logprobs.tokens
        for token in (1000, 1001)
    ]
    assert all(len(set(t)) == 1 and len(t) == 4 for t in forced), forced
    assert forced[0][0] != forced[1][0], forced
    top_only = client.completions.create(
        model=args.model, prompt="Once upon a time", max_tokens=8, temperature=1, seed=3,
        extra_body={"min_p": 1.0},
    )
    assert top_only.choices[0].text == text.choices[0].text, (top_only, text)
    if usage.completion_tokens < 16:
        longer = client.chat.completions.create(
            model=args.model, messages=messages, max_tokens=16, temperature=0,
            extra_body={"min_tokens": 16},
        )
        assert longer.usage.completion_tokens == 16, longer.usage
        assert longer.choices[0].finish_reason == "length", longer
    try:
        client.completions.create(
            model=args.model, prompt="x", logit_bias={"not-a-token": 1}
        )
        raise AssertionError("a logit_bias key that is no token id must be refused")
    except openai.BadRequestError as e:
        assert e.body["param"] == "logit_bias", e.body

    # echo with prompt logprobs, and a prompt as token ids (what lm-eval sends).
    echoed = client.completions.create(
        model=args.model, prompt="Once upon a time", max_tokens=8, temperature=0,
        echo=True, logprobs=1,
    )
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == "Once upon a time" + text.choices[0].text, echoed
    n_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + echoed.usage.completion_tokens, lp
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    assert all(x <= 0 for x in lp.token_logprobs[1:]), lp
    ids = httpx.post(
        args.base_url.removesuffix("/v1") + "/tokenize",
        json={"model": args.model, "prompt": "Once upon a time"}, timeout=60,
    ).json()["tokens"]
    assert len(ids) == n_prompt, ids
    by_ids = client.completions.create(
        model=args.model, prompt=ids, max_tokens=8, temperature=0, echo=True, logprobs=1,
    )
    assert by_ids.choices[0].logprobs.token_logprobs == lp.token_logprobs, by_ids

    # Unknown parameters: refused by name, unless on the documented harmless list.
    try:
        client.chat.completions.create(
            model=args.model, messages=messages, max_tokens=4, extra_body={"frobnicate": 1}
        )
        raise AssertionError("an unknown parameter must be refused")
    except openai.BadRequestError as e:
        assert e.body["param"] == "frobnicate", e.body
    kept = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=16, temperature=0,
        metadata={"team": "eval"}, store=False, service_tier="auto",
    )
    assert kept.choices[0].message.content == choice.message.content, kept

    first_word = text.choices[0].text.strip().split(" ")[0]
    if first_word:
        cut = client.completions.create(
            model=args.model, prompt="Once upon a time", max_tokens=8, temperature=0,
            stop=[first_word],
        )
        assert first_word not in cut.choices[0].text, cut
        assert cut.choices[0].finish_reason == "stop", cut

    several = client.completions.create(
        model=args.model, prompt="Once upon a time", max_tokens=4, temperature=0.8, seed=1, n=2
    )
    assert [c.index for c in several.choices] == [0, 1], several
    assert several.usage.completion_tokens <= 8, several.usage

    # SmolLM2's template teaches no tool format, so the router writes the tools into the
    # system turn (the generic format); the forced call comes back as a typed tool call.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "location": {"type": "string"}}}}}]
    system = (
        "You call tools. To call a tool, answer only with <tool_call> and a JSON object.\n"
        "Example:\nUser: What is the weather in London?\nAssistant: <tool_call>\n"
        '{"name": "get_weather", "arguments": {"location": "London"}}\n</tool_call>'
    )
    ask = [{"role": "system", "content": system},
           {"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(
        model=args.model, messages=ask, tools=tools, tool_choice="required",
        max_tokens=40, temperature=0,
    )
    call = called.choices[0].message.tool_calls[0]
    assert called.choices[0].finish_reason == "tool_calls", called
    assert call.function.name == "get_weather", call
    assert json.loads(call.function.arguments) == {"location": "Paris"}, call
    streamed_calls = [
        tc
        for chunk in client.chat.completions.create(
            model=args.model, messages=ask, tools=tools, tool_choice="required",
            max_tokens=40, temperature=0, stream=True,
        )
        for tc in (chunk.choices[0].delta.tool_calls or [])
    ]
    assert [(t.index, t.function.name) for t in streamed_calls] == [(0, "get_weather")], streamed_calls
    assert streamed_calls[0].function.arguments == call.function.arguments, streamed_calls

    models = client.models.list()
    assert [m.id for m in models.data] == [args.model], models

    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        raise AssertionError("an unknown model must fail")
    except openai.NotFoundError as e:
        assert e.status_code == 404

    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
