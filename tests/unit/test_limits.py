"""Per-request limits (server/limits.py) on SGLang's un-normalized request objects; the live-server
side (400s, the cap, SIGTERM, plain SGLang untouched) is tests/e2e/test_limits.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_loopkv.config import ENV_VAR, LimitsConfig, LoopKVConfig
from sgl_loopkv.server import limits

LIMITS = LimitsConfig(max_n=2, default_max_tokens=5)


def request(sampling_params):
    return SimpleNamespace(sampling_params=sampling_params, return_logprob=False)


@pytest.mark.parametrize("params", [{"n": 3}, [{"n": 3}, {"n": 3}], {"n": 1000, "max_new_tokens": 1}])
def test_n_over_the_limit_is_refused_with_the_flag_named(params):
    with pytest.raises(ValueError, match="--loopkv-max-n"):
        limits.apply_limits(request(params), LIMITS)


def test_the_cap_fills_only_an_unset_max_new_tokens():
    unset, explicit, absent = {"max_new_tokens": None, "n": 2}, {"max_new_tokens": 50}, {}
    for params in (unset, [explicit, absent], None):
        limits.apply_limits(request(params), LIMITS)
    # absent is SGLang's own default (128), not "unbounded": left to SGLang
    assert unset["max_new_tokens"] == 5 and explicit["max_new_tokens"] == 50 and absent == {}


def test_only_servers_started_by_the_launcher_are_limited(monkeypatch):
    limits.active_limits.cache_clear()
    monkeypatch.delenv(ENV_VAR, raising=False)
    params = {"n": 1000, "max_new_tokens": None}
    limits.check_generate_request(None, request(params))  # plain sglang.launch_server: untouched
    assert params == {"n": 1000, "max_new_tokens": None}
    LoopKVConfig(limits=LIMITS).to_env()
    limits.active_limits.cache_clear()
    try:
        with pytest.raises(ValueError, match="over this server's limit of 2"):
            limits.check_generate_request(None, request(params))
    finally:
        monkeypatch.delenv(ENV_VAR)
        limits.active_limits.cache_clear()
