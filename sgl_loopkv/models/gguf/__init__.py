"""GGUF weights kept in their blocks (issue 53): open a file (:class:`GGUFFile`), multiply by a block
weight (:func:`linear`). The kernels are ``kernels/gguf_linear.cpp``; :mod:`.weights` serves a loaded
model's layers from a file's blocks; :mod:`.serving` checks and sets up a ``.gguf`` ``--model-path``."""

from sgl_loopkv.models.gguf.linear import GEMV_MAX_ROWS, dequantize_rows, linear
from sgl_loopkv.models.gguf.reader import SUPPORTED_TYPES, BlockWeight, GGUFError, GGUFFile

__all__ = ["GEMV_MAX_ROWS", "SUPPORTED_TYPES", "BlockWeight", "GGUFError", "GGUFFile", "dequantize_rows", "linear"]
