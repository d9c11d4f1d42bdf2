#!/usr/bin/env bash
# The portable pass behind `make test-portable` (and CI, after `make test`):
# nbval over every notebook again, on another CPU kernel path, so that stored
# outputs that only one kind of CPU reproduces fail here rather than on a
# reader's machine or the next CI runner.
#
#   MKL_CBWR=COMPATIBLE      MKL's conditional-reproducibility mode (other rounding)
#   OMP_NUM_THREADS=1        another thread count (another order of additions)
#   ATEN_CPU_CAPABILITY      ATen's scalar kernels ("default") instead of AVX2/AVX-512
#
# Notebooks that call torch.compile keep a vectorised capability: Inductor's
# generated C++ fails to build for some kernels under "default". On an AVX-512
# CPU they run with "avx2" (still another path); elsewhere with the CPU's own.
set -u
cd "$(dirname "$0")/.."
BIN=.venv/bin
start=$SECONDS
export MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1

compiled=() plain=()
for nb in notebooks/*.ipynb; do
  if grep -q 'torch.compile(' "$nb"; then compiled+=("$nb"); else plain+=("$nb"); fi
done
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then compile_capability=avx2; else compile_capability=; fi

nbval() {
  $BIN/pytest "$@" --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider -q
}
status=0
echo "==> portable nbval: ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1 (${#plain[@]} notebooks)"
ATEN_CPU_CAPABILITY=default nbval "${plain[@]}" || status=1
label=${compile_capability:-"the CPU's own"}
echo "==> portable nbval, torch.compile notebooks: ATEN_CPU_CAPABILITY=$label (${#compiled[@]} notebooks)"
if [ -n "$compile_capability" ]; then
  # A cache of its own: Inductor's cache does not key its kernels on the
  # capability, and a kernel cached by the AVX-512 pass, loaded under "avx2",
  # computed garbage for half of 05's exp_taylor (torch 2.14.1, AMD Zen 5).
  cache=${TMPDIR:-/tmp}/torchinductor_portable_$compile_capability
  ATEN_CPU_CAPABILITY=$compile_capability TORCHINDUCTOR_CACHE_DIR=$cache \
    nbval "${compiled[@]}" || status=1
else
  nbval "${compiled[@]}" || status=1
fi
echo "Portable pass: $((SECONDS - start)) s"
exit $status
