"""``--loopkv-lifecycle-require-salt``: a request without a ``cache_salt`` shares nothing.

Such a request gets a salt of its own, unique to it (:data:`UNSALTED` + a random id), before SGLang
builds its tokenized form: its radix key and every chain hash of its history are then in a namespace
that no other request can match (the timing side channel of a shared prefix cache has nothing to
measure), and the loopkv cache does not store it in the host or disk tier (nothing could resume it).
A BEFORE hook on ``TokenizerManager._create_tokenized_object``, in servers of sgl-loopkv's launcher."""

from __future__ import annotations

import uuid

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
UNSALTED = "loopkv-unsalted-"  # a salt given here: its KV is never stored (cache.write_through)


def isolate_unsalted(self, obj, *args, **kwargs):
    """BEFORE hook: a generate request without a salt gets one of its own (``obj`` edited in place)."""
    if hasattr(obj, "return_logprob") and not getattr(obj, "cache_salt", None) and _required():
        obj.cache_salt = UNSALTED + uuid.uuid4().hex
    return None


def _required() -> bool:
    global _REQUIRED
    if _REQUIRED is None:
        from sgl_loopkv.config import LoopKVConfig

        _REQUIRED = LoopKVConfig.from_env().lifecycle.require_salt
    return _REQUIRED


_REQUIRED: bool | None = None
