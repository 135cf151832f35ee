"""The sgl-loopkv plugin is found by SGLang's own plugin loader in a fresh process."""

from __future__ import annotations

import pytest

from tests.helpers import start_fresh

LOAD_PLUGINS = """
        import json
        from importlib.metadata import entry_points
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
        from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase
        from sgl_loopkv.plugin import COMPONENTS
        import sys
        from sglang.srt.utils import common
        from sglang.srt.mem_cache.registry import registered_radix_cache_backends
        print(json.dumps({
            "radix": registered_radix_cache_backends(),
            "entry_points": [ep.value for ep in entry_points(group="sglang.srt.plugins")],
            "backend": ATTENTION_BACKENDS.get("loopkv").__module__,
            "choice": "loopkv" in ATTENTION_BACKEND_CHOICES,
            "hooked": hasattr(OpenAIServingBase.handle_request, "__wrapped__"),
            # server/metrics_files.py: hooked where SGLang mounts /metrics; prometheus_client not imported
            # before SGLang sets PROMETHEUS_MULTIPROC_DIR (its value class is fixed at import)
            "metrics_hooked": hasattr(common.add_prometheus_middleware, "__wrapped__"),
            "prometheus_imported": "prometheus_client" in sys.modules,
            "components": COMPONENTS,
        }))
        """

IDEMPOTENT = """
        import json
        from sgl_loopkv.plugin import COMPONENTS, register
        register(); register()
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase
        inner = OpenAIServingBase.handle_request.__wrapped__
        print(json.dumps({
            "n": ATTENTION_BACKEND_CHOICES.count("loopkv"),
            "c": COMPONENTS,
            # what SGLang holds, not the plugin's own bookkeeping: hooks per target, wrappers applied
            "registered": {t: len(HookRegistry._hooks[t]) for t in COMPONENTS["hook"]},
            "wrapped_twice": hasattr(inner, "__wrapped__"),
        }))
        """

DECODE_LINEAR = """
        import json
        from sgl_loopkv.plugin import COMPONENTS, register
        register()
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.models.llama import LlamaModel
        print(json.dumps({
            "lean_wrapped": hasattr(LlamaModel.forward, "__wrapped__"),
            "hooks": COMPONENTS["hook"],
            "linear_wrapped": hasattr(UnquantizedLinearMethod.apply, "__wrapped__"),
            "lm_head_wrapped": hasattr(LogitsProcessor._compute_lm_head, "__wrapped__"),
        }))
        """


@pytest.fixture(scope="module")
def fresh():
    """The snippets of the default tests, started together (each is a fresh import of SGLang)."""
    import json

    return {
        "load_plugins": start_fresh(LOAD_PLUGINS, env={"SGLANG_USE_CPU_ENGINE": "1"}),
        "idempotent": start_fresh(IDEMPOTENT),
        "launched": start_fresh(DECODE_LINEAR, env={"LOOPKV_CONFIG": json.dumps({"stock": False})}),
        "plain": start_fresh(DECODE_LINEAR, drop_env=("LOOPKV_CONFIG",)),
    }


def test_load_plugins_finds_and_registers_loopkv(fresh):
    out = fresh["load_plugins"]()
    assert "sgl_loopkv.plugin:register" in out["entry_points"]
    assert out["backend"] == "sgl_loopkv.attention.backend"
    assert out["choice"] and out["hooked"] and out["metrics_hooked"] and not out["prometheus_imported"]
    assert out["components"]["attention_backend"] == ["loopkv"]
    assert out["radix"] == ["loopkv"] and out["components"]["radix_cache_backend"] == ["loopkv"]


def test_plugin_registration_is_idempotent(fresh):
    out = fresh["idempotent"]()
    assert out["n"] == 1 and out["c"]["attention_backend"] == ["loopkv"]
    assert len(out["registered"]) == 7 and set(out["registered"].values()) == {1}, out["registered"]
    assert "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill" in out["registered"]  # cache/awaited.py
    assert not out["wrapped_twice"]


# the stock side is slow-marked (21 s, a second server): the default suite checks the loopkv side
@pytest.mark.parametrize("stock", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_decode_linear_hooks_only_in_loopkv_servers(stock, fresh):
    """The split linear layers and the lean forward are sgl-loopkv's: a server of its launcher gets
    them, its stock baseline (``--loopkv-stock``) and a plain SGLang process keep SGLang's layers."""
    import json as _json

    from sgl_loopkv.models.decode_linear import LINEAR_TARGET, LM_HEAD_TARGET
    from sgl_loopkv.models.lean_forward import TARGET as LEAN_TARGET

    if stock:
        launched = start_fresh(DECODE_LINEAR, env={"LOOPKV_CONFIG": _json.dumps({"stock": True})})()
    else:
        launched = fresh["launched"]()
    plain = fresh["plain"]()
    assert (LINEAR_TARGET in launched["hooks"]) is not stock
    assert (LM_HEAD_TARGET in launched["hooks"]) is not stock
    assert launched["linear_wrapped"] is not stock and launched["lm_head_wrapped"] is not stock
    assert (LEAN_TARGET in launched["hooks"]) is not stock and launched["lean_wrapped"] is not stock
    assert LINEAR_TARGET not in plain["hooks"] and not plain["linear_wrapped"] and not plain["lm_head_wrapped"]
    assert LEAN_TARGET not in plain["hooks"] and not plain["lean_wrapped"]
