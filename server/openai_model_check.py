"""Reject OpenAI requests that name a model this server does not serve (HTTP 404).

SGLang 0.5.23 ignores the ``model`` field of ``/v1/chat/completions`` and ``/v1/completions``:
any name is answered by the one loaded model, so a client pointed at the wrong server gets a
plausible answer from the wrong model. There is no extension point for request validation, so
this is an AROUND hook (SGLang's ``HookRegistry``) on ``OpenAIServingBase.handle_request``.

Accepted names: the served model name, the model path, ``default`` (the name SGLang's own docs
use), and ``<one of those>:<lora adapter>``. Only in servers started by sgl-loopkv's launcher: a
plain ``sglang.launch_server`` in the same environment keeps SGLang's behaviour.
"""

from __future__ import annotations

from sgl_loopkv.config import LoopKVConfig

TARGET = "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request"


def accepted_model_names(tokenizer_manager) -> set[str]:
    args = tokenizer_manager.server_args
    return {n for n in (tokenizer_manager.served_model_name, args.model_path, "default") if n}


async def check_model_name(original, self, request, raw_request, *args, **kwargs):
    model = getattr(request, "model", None)
    if model and LoopKVConfig.launched():
        names = accepted_model_names(self.tokenizer_manager)
        base = model
        if model not in names and ":" in model:
            base = next((n for n in names if model.startswith(n + ":")), model.split(":", 1)[0])
        if base not in names:
            return self.create_error_response(
                message=f"The model '{model}' does not exist. This server serves "
                f"'{self.tokenizer_manager.served_model_name}' (see GET /v1/models).",
                err_type="NotFoundError",
                status_code=404,
                param="model",
            )
    return await original(self, request, raw_request, *args, **kwargs)
