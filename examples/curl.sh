#!/usr/bin/env bash
# examples/curl.sh
# Talk to a running server (python -m sgl_loopkv.launch_server) with curl.
set -e  # --fail-with-body: an HTTP error shows its message and stops here
URL=${URL:-http://127.0.0.1:30000}
H='Content-Type: application/json'

# SGLang's native API: greedy completion of raw text.
curl -s --fail-with-body -H "$H" "$URL/generate" \
  -d '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
echo

# OpenAI-compatible chat ("default": the model this server serves; GET /v1/models names it).
curl -s --fail-with-body -H "$H" "$URL/v1/chat/completions" \
  -d '{"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'
echo
