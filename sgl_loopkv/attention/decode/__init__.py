"""Sparse decode policies, chosen by name (``--loopkv-decode-policy``): ``lserve``, ``freekv``,
``loopserve`` (:mod:`.base` has the contract); :mod:`.selector` runs them inside the backend."""

from __future__ import annotations

from sgl_loopkv.attention.decode.base import DecodeParams, DecodePolicy, LayerState, SeqKeys
from sgl_loopkv.attention.decode.freekv import FreeKVPolicy
from sgl_loopkv.attention.decode.loopserve import LoopServePolicy
from sgl_loopkv.attention.decode.lserve import LServePolicy
from sgl_loopkv.registry import Registry

#: name -> factory(params: DecodeParams) -> DecodePolicy
DECODE_POLICIES: Registry[DecodePolicy] = Registry("decode selection policy")
DECODE_POLICIES.register("lserve")(LServePolicy)
DECODE_POLICIES.register("freekv")(FreeKVPolicy)
DECODE_POLICIES.register("loopserve")(LoopServePolicy)

__all__ = ["DECODE_POLICIES", "DecodeParams", "DecodePolicy", "LayerState", "SeqKeys"]
