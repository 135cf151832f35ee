"""``sgl_kernel.utils`` of the CUDA stand-in (test infrastructure, see the package docstring)."""


def is_arch_support_pdl() -> bool:
    """No programmatic dependent launch: the stand-in's ops are plain torch."""
    return False
