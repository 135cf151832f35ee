"""Llama, Phi-3 and InternLM3: SGLang's ``sglang.srt.models.llama`` (the default model's family)."""

from sglang.srt.models.llama import EntryClass  # noqa: F401  (read by SGLang's registry)
