from sgl_loopkv.models.default_model import DEFAULT_MODEL_NAME, default_model_gguf, ensure_default_model

__all__ = ["DEFAULT_MODEL_NAME", "default_model_gguf", "ensure_default_model"]
