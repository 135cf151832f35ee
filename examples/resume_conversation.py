# examples/resume_conversation.py
"""What sgl-loopkv is for: a conversation comes back after its KV has left the device.

Two turns of a chat about a long document; then other conversations push it out of the device's KV
pool (into the host tier, later the disk tier); then the returning turn. Its history is loaded from
the tier that holds it instead of being recomputed: ``usage.prompt_tokens_details.cached_tokens``
counts it, and ``sglext.cached_tokens_details`` (asked for with ``return_cached_tokens_details``)
says which tier it came from.

The push costs twice as many tokens as the device pool holds, so start the server with a small pool:
    python -m sgl_loopkv.launch_server --max-total-tokens 4096
"""

import os

import openai
import requests

URL = os.environ.get("URL", "http://127.0.0.1:30000")
KEY = os.environ.get("OPENAI_API_KEY", "unused")  # the server's --api-key, if it has one
client = openai.OpenAI(base_url=URL + "/v1", api_key=KEY)
model = client.models.list().data[0].id
info = requests.get(URL + "/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
pool, max_input = info["max_total_num_tokens"], info["max_req_input_len"]


def ask(messages: list[dict], max_tokens: int = 24):
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_cached_tokens_details": True},
    )
    tiers = ((reply.model_extra or {}).get("sglext") or {}).get("cached_tokens_details") or {}
    return reply, {"device": tiers.get("device", 0), "host": tiers.get("host", 0), "disk": tiers.get("storage") or 0}


def document(name: str, items: int) -> str:
    colours = ["red", "blue", "green", "yellow"]
    return f"Inventory {name}. " + " ".join(f"Box {i} of {name} is {colours[i % 4]}." for i in range(items))


def report(label: str, reply, tiers: dict) -> None:
    cached = reply.usage.prompt_tokens_details.cached_tokens
    where = ", ".join(f"{tier} {n:,}" for tier, n in tiers.items())
    print(f"{label:<7} {reply.usage.prompt_tokens:>6,} prompt tokens, {cached:>6,} cached ({where})")


messages = [{"role": "user", "content": document("A", 120) + "\nWhat colour is box 7?"}]
for label, follow_up in (("turn 1", "And box 9?"), ("turn 2", "How many boxes are there?")):
    reply, tiers = ask(messages)
    report(label, reply, tiers)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
    messages += [{"role": "user", "content": follow_up}]

# Away: other conversations, one request at a time, twice as many tokens as the device pool holds
# (it frees the least recently used first, one node of the radix tree at a time).
pushed, n, per_item = 0, 0, 10.0  # tokens per "Box i of X is red." (measured after the first one)
while pushed < 2 * pool:
    items = int(min(max_input, pool) * 0.6 / per_item)
    away, _ = ask([{"role": "user", "content": document(f"other-{n}", items)}], max_tokens=1)
    pushed, n, per_item = pushed + away.usage.prompt_tokens, n + 1, away.usage.prompt_tokens / items
print(f"away    {n} other conversations, {pushed:,} tokens through a device pool of {pool:,}")

reply, tiers = ask(messages)
report("back", reply, tiers)
print("assistant:", reply.choices[0].message.content)
