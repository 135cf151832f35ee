"""The maintained benchmarks by name: the question each answers, the command that answers it, and
the code it measures (a later commit touching one of those paths makes its result stale).

Import-light on purpose: the docs generator and its test read this without torch or SGLang."""

from __future__ import annotations

from dataclasses import dataclass

_ENGINE = ("sgl_loopkv/", "kernels/", "server/")


@dataclass(frozen=True, slots=True)
class Spec:
    name: str  # results stem: benchmarks/results/<name>.{json,md,png}; module benchmarks.<name>
    title: str
    question: str  # what a reader runs it to find out
    command: str  # the full run
    quick: str | None  # a short run, where the benchmark has one
    measures: tuple[str, ...]  # repository paths (folders end in /)

    @property
    def paths(self) -> tuple[str, ...]:
        """What staleness is judged by: the measured code and the benchmark's own module."""
        return (*self.measures, f"benchmarks/{self.name}.py")


SPECS = {
    s.name: s
    for s in (
        Spec(
            "serve_smoke",
            "Serving smoke",
            "Is a returning turn faster than recomputing it, and how does decode compare with stock SGLang and HF?",
            "python -m benchmarks.serve_smoke",
            "python -m benchmarks.serve_smoke --quick",
            _ENGINE,
        ),
        Spec(
            "multiturn",
            "Multi-turn conversations",
            "Across long conversations evicted to host or disk, what do the tiers and compression cost in answers and TTFT?",
            "python -m benchmarks.multiturn",
            "python -m benchmarks.multiturn --quick",
            (*_ENGINE, "benchmarks/conversations.py"),
        ),
        Spec(
            "decode",
            "Dense decode",
            "How fast does sgl-loopkv decode per token and per batch, next to stock SGLang, HF, llama.cpp and the memory-bandwidth limit?",
            "python -m benchmarks.decode",
            "python -m benchmarks.decode --quick",
            ("sgl_loopkv/attention/", "sgl_loopkv/models/", "sgl_loopkv/cache/", "kernels/", "sgl_loopkv/platform.py"),
        ),
        Spec(
            "decode_sparse",
            "Sparse decode",
            "Which sparse-decode policy keeps answers at what speed-up over dense decode?",
            "python -m benchmarks.decode_sparse",
            None,
            ("sgl_loopkv/attention/", "kernels/"),
        ),
        Spec(
            "prefill",
            "Sparse prefill",
            "How much faster is a long prompt's prefill with a sparse policy, and what does it cost in fidelity?",
            "python -m benchmarks.prefill",
            "python -m benchmarks.prefill --quick",
            ("sgl_loopkv/attention/", "kernels/block_sparse_attn.py"),
        ),
        Spec(
            "restore",
            "Restore from host or disk",
            "How long does a returning turn wait for its history from the host arena or from disk?",
            "python -m benchmarks.restore",
            "python -m benchmarks.restore --quick",
            ("sgl_loopkv/restore/", "sgl_loopkv/cache/", "kernels/chunk_io.cpp", "kernels/chunk_io.py"),
        ),
        Spec(
            "reprefill",
            "Chunk-pruned re-prefill",
            "Which prefix budget restores a long history fastest without changing the answers?",
            "python -m benchmarks.reprefill",
            "python -m benchmarks.reprefill --quick",
            ("sgl_loopkv/cache/", "sgl_loopkv/restore/", "kernels/chunk_io.cpp", "kernels/chunk_io.py"),
        ),
        Spec(
            "soak",
            "Soak",
            "Under many concurrent conversations for minutes, does memory stay bounded and do the answers stay right?",
            "python -m benchmarks.soak",
            "python -m benchmarks.soak --quick",
            (*_ENGINE, "benchmarks/conversations.py"),
        ),
        Spec(
            "cluster",
            "Cluster",
            "With several workers behind a router, what does a shared store or cache-aware routing save?",
            "python -m benchmarks.cluster",
            None,
            (*_ENGINE, "benchmarks/conversations.py"),
        ),
    )
}
