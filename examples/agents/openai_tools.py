"""Tool calling through the OpenAI client: one round of an agent loop.

    mtplxd start --detach
    python examples/agents/openai_tools.py

The model may answer with `tool_calls` (finish_reason "tool_calls"); the script runs
them and sends the results back as `tool` messages. Reasoning models' <think> text
arrives separately as `reasoning_content`. A small model may well not call the tool:
then its answer is plain text, never raw <tool_call> markup.
"""

import json
import os

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8765/v1", api_key=os.environ.get("MTPLXD_API_KEY", "unused"))
TOOLS = [{"type": "function", "function": {
    "name": "count_lines", "description": "Number of lines of a text file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def count_lines(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return str(sum(1 for _ in f))


messages = [{"role": "user", "content": "How many lines has README.md?"}]
reply = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, max_tokens=256)
message = reply.choices[0].message
print("finish_reason:", reply.choices[0].finish_reason)
print("reasoning:", (message.model_extra or {}).get("reasoning_content"))
if message.tool_calls:
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        result = count_lines(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # Streamed this time: text arrives in delta.content, calls whole in delta.tool_calls.
    for chunk in client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                                max_tokens=256, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
else:
    print("answer:", message.content)
