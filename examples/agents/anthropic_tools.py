"""Tool use through the Anthropic client (the Messages API at /v1/messages).

    mtplxd start --detach
    python examples/agents/anthropic_tools.py

The daemon accepts `x-api-key` (what this client sends) and `Authorization: Bearer`.
`thinking` turns reasoning models' <think> text into thinking blocks; without it the
template is asked not to think.
"""

import os

import anthropic

client = anthropic.Anthropic(base_url="http://127.0.0.1:8765", api_key=os.environ.get("MTPLXD_API_KEY", "unused"))
TOOLS = [{"name": "count_lines", "description": "Number of lines of a text file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def count_lines(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return str(sum(1 for _ in f))


messages = [{"role": "user", "content": "How many lines has README.md?"}]
print("prompt tokens:", client.messages.count_tokens(model="default", messages=messages, tools=TOOLS).input_tokens)
reply = client.messages.create(model="default", max_tokens=2048, messages=messages, tools=TOOLS,
                               thinking={"type": "enabled", "budget_tokens": 1024})
print("stop_reason:", reply.stop_reason, "| blocks:", [b.type for b in reply.content])
calls = [b for b in reply.content if b.type == "tool_use"]
if calls:
    messages.append({"role": "assistant", "content": reply.content})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": c.id, "content": count_lines(**c.input)} for c in calls]})
    # Streamed: the SDK assembles the events (message_start ... message_stop) into a message.
    with client.messages.stream(model="default", max_tokens=1024, messages=messages, tools=TOOLS) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
    print()
