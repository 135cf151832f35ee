#!/usr/bin/env bash
# The in-server GPU check of issue 56, in one call on the lent GPU machine (no network, no SGLang,
# FlashInfer or sgl-kernel there). Unpacks the carried bundle (benchmarks/gpu_bundle.py), puts the
# CUDA stand-in for sgl_kernel (tests/gpu_standin, test infrastructure) on the path, then runs
# benchmarks/gpu_server.py; its JSON and the server logs go to $OUT.
#   build here first:  python -m benchmarks.gpu_bundle all
#   device call:       run(command="bash benchmarks/gpu_server.sh", carry=[".gpu_bundle"], timeout_s=540)
#   usage: bash benchmarks/gpu_server.sh [phases]   (default greedy,dense,resume,sparse; GPU_ARGS=... for
#   more benchmarks/gpu_server.py flags, e.g. GPU_ARGS="--llama-layers 2")
#   copy $OUT/gpu_server.json to benchmarks/results/gpu_server.json afterwards.
set -u
phases=${1:-greedy,dense,resume,sparse}
OUT=${OUT:-/tmp/out}
B=$PWD/.gpu_bundle
SITE=/tmp/site
mkdir -p "$OUT" "$SITE" /tmp/gpu_server
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ -f "$B/manifest.json" ] || { echo "no bundle: carry .gpu_bundle (python -m benchmarks.gpu_bundle all)"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$B"/wheels/*.whl || exit 1
tar -xJf "$B/sglang.tar.xz" -C "$SITE" || exit 1
[ -f "$B/flashinfer.tar.xz" ] && { tar -xJf "$B/flashinfer.tar.xz" -C "$SITE" || exit 1; }
tar -xJf "$B/tokenizer.tar.xz" -C /tmp/gpu_server || exit 1
stamp "bundle unpacked"
# sgl_loopkv.kernels / .server live in kernels/ and server/ (pyproject package-dir): map them
mkdir -p /tmp/shim && cat >/tmp/shim/sitecustomize.py <<PY
import importlib.util, sys
class _Map:
    DIRS = {"sgl_loopkv.kernels": "$PWD/kernels", "sgl_loopkv.server": "$PWD/server"}
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        d = cls.DIRS.get(name)
        return d and importlib.util.spec_from_file_location(name, d + "/__init__.py", submodule_search_locations=[d])
sys.meta_path.append(_Map)
PY
# SGLang registers plugins in each of its processes from entry points: give sgl_loopkv's one a dist-info
D="$SITE/sgl_loopkv-0.1.0.dist-info" && mkdir -p "$D"
printf 'Metadata-Version: 2.1\nName: sgl-loopkv\nVersion: 0.1.0\n' >"$D/METADATA"
printf '[sglang.srt.plugins]\nloopkv = sgl_loopkv.plugin:register\n' >"$D/entry_points.txt"
export PYTHONPATH=/tmp/shim:$SITE:$PWD:$PWD/tests/gpu_standin
export PYTHONUNBUFFERED=1 SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws TORCH_CUDA_ARCH_LIST=9.0a FLASHINFER_CUDA_ARCH_LIST=9.0a
python3 -c "import sglang, sgl_kernel, sgl_loopkv.plugin, torch; from importlib.metadata import entry_points as e; assert any(x.name == 'loopkv' for x in e(group='sglang.srt.plugins')); print('sglang', sglang.__version__, 'stand-in', sgl_kernel.IS_SGL_LOOPKV_STANDIN, torch.cuda.get_device_name())" || exit 1
stamp "imports ok"
set -o pipefail
python3 -m benchmarks.gpu_server --phases "$phases" --out "$OUT/gpu_server.json" --work /tmp/gpu_server \
  --tokenizer /tmp/gpu_server/tokenizer ${GPU_ARGS:-} 2>&1 | tee "$OUT/gpu_server.log" | tail -60
rc=$?
tar -czf "$OUT/server_logs.tar.gz" -C /tmp/gpu_server logs 2>/dev/null
stamp "end (rc $rc)"
exit $rc
