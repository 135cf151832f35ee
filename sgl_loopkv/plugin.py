"""The SGLang plugin (entry point group ``sglang.srt.plugins``).

SGLang calls :func:`register` in every process it starts (launcher, scheduler, detokenizer, DP
controller) through ``sglang.srt.plugins.load_plugins()``; registration is idempotent.

What it registers today:
- the ``sgl_kernel`` CPU stand-in (only with SGLang's CPU engine and no real sgl_kernel);
- the ``loopkv`` attention backend (``--attention-backend loopkv``);
- a check that OpenAI requests name the served model (:mod:`sgl_loopkv.server.openai_model_check`).
The radix-cache backend (tiered KV store) and the sparse planners come with their own issues and
are added to :data:`COMPONENTS` here, nowhere else.
"""

from __future__ import annotations

import logging

from sgl_loopkv.platform import activate_cpu_standin

logger = logging.getLogger(__name__)

#: What the plugin registered in this process: kind -> names (for tests and /server_info readers).
COMPONENTS: dict[str, list[str]] = {"attention_backend": [], "radix_cache_backend": [], "hook": []}


def register() -> None:
    # Before anything imports sglang.srt: its modules import sgl_kernel at import time.
    activate_cpu_standin()
    _register_attention_backend()
    _register_hooks()


def _register_attention_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from sgl_loopkv.attention.backend import BACKEND_NAME, create_loopkv_backend

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_loopkv_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in COMPONENTS["attention_backend"]:
        COMPONENTS["attention_backend"].append(BACKEND_NAME)


def _register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_loopkv.server import openai_model_check

    if openai_model_check.TARGET in COMPONENTS["hook"]:
        return
    HookRegistry.register(openai_model_check.TARGET, openai_model_check.check_model_name, HookType.AROUND)
    COMPONENTS["hook"].append(openai_model_check.TARGET)
    # load_plugins() applies hooks after calling every plugin; this also covers a direct call.
    HookRegistry.apply_hooks()
