"""``sgl_kernel.kvcacheio`` of the CUDA stand-in: SGLang's HiCache transfers, imported at import time
and unused on the Llama path (sgl-loopkv's tiers copy with torch). Test infrastructure."""

from sgl_kernel.ops import placeholder

NAMES = tuple(
    f"transfer_kv_{s}"
    for s in (
        "all_layer",
        "all_layer_direct_lf_pf",
        "all_layer_lf_pf",
        "all_layer_lf_ph",
        "all_layer_mla",
        "all_layer_mla_lf_pf",
        "direct",
        "per_layer",
        "per_layer_direct_pf_lf",
        "per_layer_mla",
        "per_layer_mla_pf_lf",
        "per_layer_pf_lf",
        "per_layer_ph_lf",
    )
)
globals().update({name: placeholder(name) for name in NAMES})
