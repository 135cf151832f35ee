"""The model architectures an sgl-loopkv server registers with SGLang up front.

SGLang's model registry imports every module of ``sglang.srt.models`` (~285 of them) in each server
process at import time, unless ``SGLANG_EXTERNAL_MODEL_PACKAGE`` names a package: then it registers
that package's ``EntryClass`` models and imports its own only when asked for an architecture the
package lacks (``ModelRegistry.resolve_model_cls`` / ``is_arch_supported``). The launcher names
this package (:data:`PACKAGE`, unless the variable is set already, even to ``""``, which keeps
SGLang's registry as it ships, or ``--loopkv-stock`` runs SGLang as it ships): a server of a
Llama-family model (the default model's) starts ~0.6 s sooner (23.4 vs 24.0 s, SmolLM2, 2 cores)
and its scheduler holds ~40 MB less; any other architecture still loads, at SGLang's usual cost.

Each module here re-exports one SGLang model module's ``EntryClass``; nothing is reimplemented.
"""

PACKAGE = __name__
ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
