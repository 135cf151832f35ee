"""sgl-loopkv: an SGLang extension that makes long multi-turn conversations cheap to keep and fast
to resume. It plugs into real SGLang through its plugin entry point (:mod:`sgl_loopkv.plugin`)."""

__version__ = "0.1.0"
