# examples/openai_chat.py
"""A two-turn chat with the official ``openai`` client; the second turn reuses the first turn's KV
(``prompt_tokens_details.cached_tokens``). Start the server first: python -m sgl_loopkv.launch_server"""

import os

import openai

client = openai.OpenAI(base_url=os.environ.get("URL", "http://127.0.0.1:30000") + "/v1", api_key="unused")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
for question in ["And which one comes first?"]:
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
    print("assistant:", reply.choices[0].message.content)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": question},
    ]
reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
print("assistant:", reply.choices[0].message.content)
print(
    "cached prompt tokens on turn 2:", reply.usage.prompt_tokens_details.cached_tokens, "of", reply.usage.prompt_tokens
)
