"""The SGLang plugin (entry point group ``sglang.srt.plugins``).

SGLang calls :func:`register` in every process it starts (launcher, scheduler, detokenizer, DP
controller) through ``sglang.srt.plugins.load_plugins()``; registration is idempotent.

What it registers today:
- the components of the modules outside the package that ``LOOPKV_EXTENSIONS`` names (a benchmark's
  baseline, :mod:`sgl_loopkv.extensions`);
- the process's shared state (:mod:`sgl_loopkv.context`), set once;
- the ``sgl_kernel`` CPU stand-in (only with SGLang's CPU engine and no real sgl_kernel);
- the ``loopkv`` attention backend (``--attention-backend loopkv``);
- the ``loopkv`` radix-cache backend (``--radix-cache-backend loopkv``): tiered conversation KV;
- a check that OpenAI requests name the served model (:mod:`sgl_loopkv.server.openai_model_check`);
- per-request limits and a bounded stop after SIGTERM (:mod:`sgl_loopkv.server.limits`);
- ``GET /metrics`` kept up while a process is creating its metrics file (:mod:`sgl_loopkv.server.metrics_files`);
- API keys redacted from /server_info, the start-up log and crash dumps (:mod:`sgl_loopkv.server.redact`);
- bad input answered with a readable 4xx, never a 5xx or a server path (:mod:`sgl_loopkv.server.errors`,
  :mod:`sgl_loopkv.server.request_checks`), in servers of sgl-loopkv's launcher;
- ``POST /loopkv/forget`` answered on the scheduler (:mod:`sgl_loopkv.server.forget`), and requests
  without a ``cache_salt`` isolated under ``--loopkv-lifecycle-require-salt`` (:mod:`sgl_loopkv.server.salt`);
- per-tier ``cached_tokens_details`` in ``meta_info`` (:mod:`sgl_loopkv.cache.backend`);
- requests whose history another worker is writing, or that the disk tier is reading ahead, held back
  in the queue, not waited for on the scheduler thread (:mod:`sgl_loopkv.cache.awaited`);
- decode-step linear layers on our CPU kernels (:mod:`sgl_loopkv.models.decode_linear`) and
  Llama forwards without SGLang's per-layer machinery (:mod:`sgl_loopkv.models.lean_forward`), in
  servers of sgl-loopkv's launcher other than ``--loopkv-stock``; for a ``.gguf`` model path (and with
  ``--loopkv-weights gguf``) the linear layers and embedding served from the file's blocks
  (:mod:`sgl_loopkv.models.gguf.weights`), SGLang's CUDA-only GGUF methods given a CPU implementation.
New components are registered here, nowhere else.
"""

from __future__ import annotations

import logging
import multiprocessing

from sgl_loopkv.extensions import load_extensions
from sgl_loopkv.platform import activate_cpu_standin

logger = logging.getLogger(__name__)

#: What the plugin registered in this process: kind -> names (for tests and /server_info readers).
COMPONENTS: dict[str, list[str]] = {"attention_backend": [], "radix_cache_backend": [], "hook": []}


def register() -> None:
    # Before anything imports sglang.srt: its modules import sgl_kernel at import time.
    activate_cpu_standin()
    load_extensions()  # modules outside the package named by LOOPKV_EXTENSIONS register their components
    _set_context()
    _register_attention_backend()
    _register_radix_cache_backend()
    _register_hooks()


def _set_context() -> None:
    from sgl_loopkv.cache.importance import ChunkImportance
    from sgl_loopkv.context import Context, has_context, set_context
    from sgl_loopkv.krul.observer import KrulObserver

    if not has_context():
        set_context(Context(importance=ChunkImportance(), observer=KrulObserver()))


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


def _register_radix_cache_backend() -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from sgl_loopkv.cache.backend import BACKEND_NAME, create_loopkv_radix_cache

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_loopkv_radix_cache)
    if BACKEND_NAME not in COMPONENTS["radix_cache_backend"]:
        COMPONENTS["radix_cache_backend"].append(BACKEND_NAME)


def _register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_loopkv.cache import awaited
    from sgl_loopkv.cache import backend as cache_backend
    from sgl_loopkv.config import LoopKVConfig
    from sgl_loopkv.models import decode_linear, lean_forward, precision
    from sgl_loopkv.models.gguf import serving as gguf_serving
    from sgl_loopkv.models.gguf.linear import use_activations
    from sgl_loopkv.server import (
        errors,
        forget,
        limits,
        metrics_files,
        openai_model_check,
        redact,
        request_checks,
        salt,
    )

    hooks = [
        (openai_model_check.TARGET, openai_model_check.check_model_name, HookType.AROUND),
        (cache_backend.CACHED_TOKENS_DETAILS_TARGET, cache_backend.cached_tokens_details, HookType.AROUND),
        (awaited.TARGET, awaited.hold_back_awaited, HookType.AROUND),
        (limits.GENERATE_TARGET, limits.check_generate_request, HookType.BEFORE),
        (limits.SIGTERM_TARGET, limits.abort_after_grace, HookType.AROUND),
        (redact.REDACT_TARGET, redact.redact_secret_fields, HookType.AFTER),
        (metrics_files.MOUNT_TARGET, metrics_files.hook_reader_on_mount, HookType.BEFORE),
    ]
    if LoopKVConfig.launched():
        hooks += [
            (request_checks.TARGET, request_checks.check_request_values, HookType.AFTER),
            (request_checks.DETOKENIZE_TARGET, request_checks.check_detokenize_request, HookType.AFTER),
            (request_checks.EMBED_NORMALIZE_TARGET, request_checks.normalize_embedding_request, HookType.AROUND),
            (forget.CONTROL_TARGET, forget.handle_control, HookType.AROUND),
            (salt.TARGET, salt.isolate_unsalted, HookType.BEFORE),
        ]
        if multiprocessing.parent_process() is None:  # the launcher: the HTTP server's process, not a child
            hooks.append((errors.LAUNCH_TARGET, errors.install_on_launch, HookType.AROUND))
        else:  # a scheduler or detokenizer
            limits.leave_sigterm_to_the_launcher()
    if LoopKVConfig.launched() and not LoopKVConfig.from_env().stock:  # the baseline keeps SGLang's layers
        hooks += [
            (decode_linear.LINEAR_TARGET, decode_linear.linear_apply, HookType.AROUND),
            (decode_linear.LM_HEAD_TARGET, decode_linear.compute_lm_head, HookType.AROUND),
            (lean_forward.TARGET, lean_forward.lean_model_forward, HookType.AROUND),
        ]
        if LoopKVConfig.from_env().weights == "gguf":  # linears and embedding from a GGUF file's blocks
            use_activations(LoopKVConfig.from_env().gguf_activations)
            precision.use(LoopKVConfig.from_env().prefill_dtype, LoopKVConfig.from_env().prefill_softmax)
            hooks += [
                (decode_linear.EMBEDDING_TARGET, decode_linear.embedding, HookType.AROUND),
                (decode_linear.GGUF_EMBEDDING_TARGET, decode_linear.embedding, HookType.AROUND),
                (decode_linear.GGUF_LINEAR_TARGET, decode_linear.gguf_linear_apply, HookType.AROUND),
                (decode_linear.LOAD_TARGET, decode_linear.attach_gguf_after_load, HookType.AFTER),
                (gguf_serving.ARCHITECTURE_TARGET, gguf_serving.read_architecture, HookType.AROUND),
                (
                    gguf_serving.CHECKPOINT_TARGET,
                    gguf_serving.checkpoint_hook(LoopKVConfig.from_env().resolved_cache_dir),
                    HookType.AROUND,
                ),
                (gguf_serving.EXTRA_NAMES_TARGET, gguf_serving.extra_tensor_names, HookType.AROUND),
                (gguf_serving.WEIGHTS_TARGET, gguf_serving.quant_weights, HookType.AROUND),
            ]
    for target, hook, kind in hooks:
        if target not in COMPONENTS["hook"]:
            HookRegistry.register(target, hook, kind)
            COMPONENTS["hook"].append(target)
    # load_plugins() applies hooks after calling every plugin; this also covers a direct call.
    HookRegistry.apply_hooks()
