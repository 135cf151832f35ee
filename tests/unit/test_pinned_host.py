"""The host tier's buffers are page-locked on CUDA only, and ``LOOPKV_HOST_PINNED=0`` turns that off
(sgl_loopkv/cache/copy_stream.py). On CPU nothing is pinned: CPU behaviour is unchanged."""

import torch

from sgl_loopkv.cache.copy_stream import pinned_host


def test_pinned_on_cuda_unless_turned_off_never_on_cpu():
    assert pinned_host("cuda", {}) and pinned_host(torch.device("cuda", 0), {"LOOPKV_HOST_PINNED": "1"})
    assert not pinned_host("cuda", {"LOOPKV_HOST_PINNED": "0"}) and not pinned_host(
        "cuda", {"LOOPKV_HOST_PINNED": "false"}
    )
    assert not pinned_host("cpu", {}) and not pinned_host(torch.device("cpu"), {"LOOPKV_HOST_PINNED": "1"})
