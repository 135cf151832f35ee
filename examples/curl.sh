#!/usr/bin/env bash
# Talk to a running server (python -m sgl_loopkv.launch_server) with curl.
URL=${URL:-http://127.0.0.1:30000}
H='Content-Type: application/json'

# SGLang's native API: greedy completion of raw text.
curl -s -H "$H" "$URL/generate" \
  -d '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
echo

# OpenAI-compatible chat.
curl -s -H "$H" "$URL/v1/chat/completions" \
  -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'
echo
