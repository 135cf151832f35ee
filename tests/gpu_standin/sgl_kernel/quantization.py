"""``sgl_kernel.quantization`` of the CUDA stand-in: GGUF kernels SGLang imports at import time,
unused for an unquantized Llama. Test infrastructure."""

from sgl_kernel.ops import placeholder

NAMES = ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8")
globals().update({name: placeholder(name) for name in NAMES})
