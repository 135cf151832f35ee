#!/usr/bin/env bash
# One call on a lent GPU machine (no network): install the carried FlashInfer and tvm-ffi, build
# FlashInfer's JIT modules in the background while the Triton/dense GPU tests run, then the
# FlashInfer tests and benchmarks/gpu_sparse.py. Logs and results go to $OUT; a short table last.
#   carry: .whl (apache_tvm_ffi-*.whl, fi/flashinfer-stripped.tar.xz, optional fi/fi_cache.tar.xz)
#   usage: bash benchmarks/gpu_device.sh [tests|bench|all|fi|decode]   (default all; BENCH_ARGS=... for
#   benchmarks/gpu_sparse.py, DECODE_ARGS=... for benchmarks/gpu_decode.py)
#   fi: all but the Triton/dense GPU tests (~2 min of Triton compiles), for changes to the FlashInfer path
#   decode: every GPU test, then benchmarks/gpu_decode.py (sparse decode) instead of gpu_sparse.py;
#   all runs both benchmarks; GPU_TESTS=... narrows the GPU test files
# Making .whl here (ignored via .git/info/exclude): the flashinfer-python 0.7.2 wheel is 62 MiB, over
# what a call may carry, so it travels stripped: unzip it, delete data/csrc/*/ (other kernels' sources)
# and every non-.py file outside data/, tar.xz flashinfer/ + its dist-info (13 MB). Its other
# Requires-Dist are on the image or not imported, except apache-tvm-ffi (cp312 manylinux wheel).
# fi_cache.tar.xz is a previous call's $OUT/fi_cache.tar.xz (FlashInfer's JIT builds; saves ~1 min).
set -u
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws TORCH_CUDA_ARCH_LIST=9.0a FLASHINFER_CUDA_ARCH_LIST=9.0a
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
tar -xJf .whl/fi/flashinfer-stripped.tar.xz -C /tmp/site || exit 1
[ -f .whl/fi/fi_cache.tar.xz ] && mkdir -p /tmp/fiws && tar -xJf .whl/fi/fi_cache.tar.xz -C /tmp/fiws && stamp "restored JIT cache"
export PYTHONPATH=/tmp/site:$PWD
# sgl_loopkv.kernels / .server live in kernels/ and server/ (pyproject package-dir): editable install
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/install.log 2>&1; then
  tail -5 /tmp/install.log; stamp "editable install failed: sitecustomize shim"
  mkdir -p /tmp/shim && cat >/tmp/shim/sitecustomize.py <<PY
import importlib.util, os, sys
class _Map:
    DIRS = {"sgl_loopkv.kernels": "$PWD/kernels", "sgl_loopkv.server": "$PWD/server"}
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        d = cls.DIRS.get(name)
        return d and importlib.util.spec_from_file_location(name, d + "/__init__.py", submodule_search_locations=[d])
sys.meta_path.append(_Map)
PY
  export PYTHONPATH=/tmp/shim:$PYTHONPATH
fi
python3 -c "import torch, triton, flashinfer, sgl_loopkv.kernels.block_sparse_attn as b; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())" || exit 1
stamp "setup done"

# FlashInfer JIT (one module per backend and dtype) in the background, all at once
warm() {
  python3 - "$1" "$2" <<'PY'
import sys, time, torch
from sgl_loopkv.attention import build_dense_plan
from sgl_loopkv.attention.sparse.flashinfer import FlashInferSparseExecutor
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan
dt, t = getattr(torch, sys.argv[1]), time.time()
q = torch.randn(100, 9, 64, device="cuda", dtype=dt); k = torch.randn(100, 3, 64, device="cuda", dtype=dt)
plan = SparsePlan(build_dense_plan(torch.arange(100, dtype=torch.int32)[None], [0], [100], [100]), [SeqMask.all_blocks(3, 100, 100, 64)])
FlashInferSparseExecutor(backend=sys.argv[2]).run(plan, q, k, k, 0.125, torch.empty_like(q)); torch.cuda.synchronize()
print(sys.argv[1:], "flashinfer JIT ready in", round(time.time() - t, 1), "s")
PY
}
warm_decode() {  # the sparse decode path's modules (CUDA-core decode; tensor cores: fa2 prefill), head dim $2
  python3 - "$1" "${2:-64}" <<'PY'
import sys, time, torch
from sgl_loopkv.attention.decode_gpu import FlashInferSparseDecode
dt, d, t = getattr(torch, sys.argv[1]), int(sys.argv[2]), time.time()
q = torch.randn(2, 9, d, device="cuda", dtype=dt); k = torch.randn(100, 3, d, device="cuda", dtype=dt)
indptr, slots = torch.arange(7) * 10, torch.arange(60) % 100
for tc in (False, True):
    FlashInferSparseDecode(use_tensor_cores=tc)(q, k, k, indptr, slots, 0.125, torch.empty_like(q))
torch.cuda.synchronize(); print(sys.argv[1:], "flashinfer decode JIT ready in", round(time.time() - t, 1), "s")
PY
}
pids=()
for b in fa3 fa2; do for d in float16 bfloat16; do
  warm $d $b >>"$OUT/fi_warm.log" 2>&1 &
  pids+=($!)
done; done
for d in float16 bfloat16; do
  warm_decode $d >>"$OUT/fi_warm.log" 2>&1 &
  pids+=($!)
done
if [ "$what" = all ] || [ "$what" = decode ]; then  # gpu_decode.py's Llama-3-8B geometry (head dim 128)
  warm_decode bfloat16 128 >>"$OUT/fi_warm.log" 2>&1 &
  pids+=($!)
fi

PYTEST="python3 -m pytest -p no:cacheprovider -q -rfEsx --timeout 600 -o addopts="
GPU_TESTS=${GPU_TESTS:-tests/unit/test_sparse_gpu.py tests/unit/test_sparse_decode_gpu.py tests/unit/test_tier_copies_gpu.py}  # narrower: less compile time
FI_TESTS="flashinfer or loopserve or request_lists"
if [ "$what" = all ] || [ "$what" = tests ] || [ "$what" = decode ]; then
  $PYTEST $GPU_TESTS -k "not ($FI_TESTS) and not interpreter" 2>&1 | tee "$OUT/pytest.log" | tail -25
  stamp "triton/dense tests done"
fi
wait "${pids[@]}"
stamp "flashinfer warm-up finished"; grep -E "ready|Error|error" "$OUT/fi_warm.log" | tail -8
if [ "$what" != bench ]; then
  $PYTEST $GPU_TESTS -k "($FI_TESTS) and not interpreter" 2>&1 | tee -a "$OUT/pytest.log" | tail -25
  # the interpreter tests need Triton >= 3.8's interpreter (3.6's cannot loop over loaded bounds)
  $PYTEST tests/unit/test_sparse_kernels.py -k "not interpreter" 2>&1 | tee -a "$OUT/pytest.log" | tail -3
  stamp "flashinfer tests done"
fi
if [ "$what" = all ] || [ "$what" = decode ]; then
  timeout ${DECODE_TIMEOUT:-240} python3 -m benchmarks.gpu_decode --out "$OUT" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" | grep -v '^{' | tail -40
  stamp "decode benchmark done"
fi
if [ "$what" = all ] || [ "$what" = bench ] || [ "$what" = fi ]; then
  python3 -m benchmarks.gpu_sparse --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v '^{' | tail -60
  stamp "benchmark done"
fi
# keep the compiled FlashInfer modules for the next call (carry back as .whl/fi/fi_cache.tar.xz)
tar -cf - -C /tmp/fiws .cache 2>/dev/null | xz -T0 -1 >"$OUT/fi_cache.tar.xz" && ls -la "$OUT/fi_cache.tar.xz"
stamp "end"
