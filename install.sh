#!/usr/bin/env bash
# Install sgl-loopkv with real SGLang 0.5.23 (CPU) into ./.venv. Idempotent: a second run with
# unchanged requirements does nothing. Usage: ./install.sh [--test]   (--test adds test tools)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${SGL_LOOPKV_VENV:-.venv}
PYTHON=${PYTHON:-python3}

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "install.sh: Python >= 3.11 is required (set PYTHON=...)" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q -c requirements/constraints.txt)

reqs=(-r requirements/cpu.txt)
[ "${1:-}" = "--test" ] && reqs+=(-r requirements/test.txt)
stamp="$VENV/.sgl-loopkv-$(cat install.sh requirements/*.txt | sha256sum | cut -c1-16)${1:-}"
if [ ! -f "$stamp" ]; then
  start=$(date +%s)
  echo "install.sh: installing torch, SGLang and dependencies into $VENV (about 2 minutes) ..." >&2
  "${pip[@]}" torch torchvision "${reqs[@]}"
  # SGLang's metadata pins the CUDA stack (flashinfer, sglang-kernel, ...): install it bare.
  "${pip[@]}" --no-deps -r requirements/nodeps.txt
  touch "$stamp"
  echo "install.sh: dependencies installed in $(( $(date +%s) - start )) s" >&2
fi
"${pip[@]}" --no-deps --no-build-isolation -e .
# kernels/ and server/ import as sgl_loopkv.kernels / .server (pyproject's package-dir): links in the
# package folder let lint-imports, which walks that folder, see and check them (gitignored).
for part in kernels server; do
  [ -e "sgl_loopkv/$part" ] || ln -s "../$part" "sgl_loopkv/$part"
done
# The native paged-decode kernel, compiled once per machine into the user cache (about a minute);
# without a C++ compiler the server still runs, on the slower torch decode paths.
"$VENV/bin/python" -m sgl_loopkv.kernels.paged_decode >/dev/null 2>&1 \
  || echo "install.sh: the native decode kernel did not build (no C++ compiler?); decode uses torch paths" >&2
