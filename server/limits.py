"""What one request may ask of the server, and a bounded stop (``LimitsConfig``'s flags).

SGLang 0.5.23 accepts any ``n`` and, for an OpenAI request without ``max_tokens``, generates up to
the whole context: one chat request with ``"n": 1000`` queued hours of CPU work, and SIGTERM then
waited for all of it (its ``TokenizerManager.sigterm_watchdog`` drains every request). Two hooks
(SGLang's ``HookRegistry``), no copied SGLang code:

- BEFORE ``TokenizerManager.generate_request``, where every entry point meets (``/generate``, the
  OpenAI endpoints, frontend programs): over-limit requests raise ``ValueError``, which SGLang
  answers with HTTP 400 and the message; a request that sets no ``max_new_tokens`` gets the
  default cap.
- AROUND ``TokenizerManager.sigterm_watchdog``: beside SGLang's drain loop, a task that aborts
  what still runs once the grace period after SIGTERM is over, so the drain ends and the server
  exits (every completed store is already on disk: the disk writer flushes at exit).

Both act only in a server started by ``python -m sgl_loopkv.launch_server``; the plugin leaves a
plain ``sglang.launch_server`` in the same environment as SGLang made it.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from sgl_loopkv.config import LimitsConfig, LoopKVConfig

logger = logging.getLogger(__name__)

GENERATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
SIGTERM_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog"


@functools.cache
def active_limits() -> LimitsConfig | None:
    """This server's limits, or None where sgl-loopkv's launcher did not start it."""
    return LoopKVConfig.from_env().limits if LoopKVConfig.launched() else None


def apply_limits(obj, limits: LimitsConfig) -> None:
    """Raise ``ValueError`` when a ``GenerateReqInput`` (before SGLang normalizes it) asks for more
    than ``limits`` allow; give ``max_new_tokens`` the default cap where it is unset (None: the
    OpenAI adapters' spelling of "not given"; a missing key is SGLang's own default, 128)."""
    params = obj.sampling_params
    for p in params if isinstance(params, list) else [params] if params is not None else []:
        n = p.get("n")
        if isinstance(n, int) and n > limits.max_n:  # other values are SGLang's to reject
            raise ValueError(f"n={n!r} is over this server's limit of {limits.max_n} (--loopkv-max-n)")
        if "max_new_tokens" in p and p["max_new_tokens"] is None:
            p["max_new_tokens"] = limits.default_max_tokens


def check_generate_request(self, obj, *args, **kwargs):
    """BEFORE hook on ``TokenizerManager.generate_request``."""
    limits = active_limits()
    if limits is not None and hasattr(obj, "return_logprob"):  # GenerateReqInput, not an embedding
        apply_limits(obj, limits)
    return None  # arguments unchanged (``obj`` is edited in place)


async def abort_after_grace(original, self):
    """AROUND hook on ``TokenizerManager.sigterm_watchdog``."""
    limits = active_limits()
    if limits is not None:
        task = asyncio.get_running_loop().create_task(_abort_when_stopping(self, limits.shutdown_grace_s))
        self.asyncio_tasks.add(task)  # SGLang keeps its own tasks there (a reference, and cancelled on exit)
    return await original(self)


async def _abort_when_stopping(tokenizer_manager, grace_s: float) -> None:
    while not tokenizer_manager.gracefully_exit:
        await asyncio.sleep(0.5)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while tokenizer_manager.rid_to_state and loop.time() < deadline:
        await asyncio.sleep(0.25)
    if tokenizer_manager.rid_to_state:
        logger.warning(
            "stopping: aborting %d request(s) still running %.0f s after SIGTERM (--loopkv-shutdown-grace-s)",
            len(tokenizer_manager.rid_to_state),
            grace_s,
        )
        tokenizer_manager.abort_request(abort_all=True)
