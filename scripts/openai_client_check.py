"""Drives kvq serve with the official openai client; prints one JSON line of what it got.

Used by tests/it/serve_openai.rs. Usage: openai_client_check.py --base-url URL/v1 --api-key KEY
"""
import argparse
import json

import openai

ap = argparse.ArgumentParser()
ap.add_argument("--base-url", required=True)
ap.add_argument("--api-key", required=True)
a = ap.parse_args()

client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0)
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "What is the capital of France?"}]

chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens > 0

parts = []
usage = None
for chunk in client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=16,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage is not None:
        usage = chunk.usage
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8)
comp_parts = [
    c.choices[0].text
    for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, stream=True
    )
    if c.choices
]

# kvq's extension through the client's extra_body: no stop at the end-of-sequence token.
fixed = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=24, extra_body={"ignore_eos": True}
)


def status_of(call):
    try:
        call()
    except openai.APIStatusError as e:
        return e.status_code
    return 200


bad_key = openai.OpenAI(base_url=a.base_url, api_key="wrong", max_retries=0)
print(
    json.dumps(
        {
            "chat": chat.choices[0].message.content,
            "chat_finish": chat.choices[0].finish_reason,
            "chat_stream": "".join(parts),
            "completion": comp.choices[0].text,
            "completion_stream": "".join(comp_parts),
            "ignore_eos_tokens": fixed.usage.completion_tokens,
            "ignore_eos_finish": fixed.choices[0].finish_reason,
            "bad_key_status": status_of(lambda: bad_key.models.list()),
            "bad_model_status": status_of(
                lambda: client.chat.completions.create(
                    model="no-such-model", messages=messages, max_tokens=2
                )
            ),
        }
    )
)
