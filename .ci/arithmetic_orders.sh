#!/usr/bin/env bash
# The reordered tests (pytest -m reordered: two runs whose float sums are ordered differently,
# compared by tests/helpers/runs.py's rule) under arithmetic other than this machine's default:
# settings that change BLAS's and ATen's kernels and blocking, and the threads per rank. A
# comparison whose tolerance is only this CPU's luck fails here, not on a user's machine.
#
#   .ci/arithmetic_orders.sh                 every setting, then a table
#   .ci/arithmetic_orders.sh aten-default    one (or a few) by name
#
# What each changes, measured on an AMD EPYC (AVX-512) with torch 2.13's MKL 2024.2 (docs/design.md):
# MKL takes its non-Intel path on AMD, so MKL_ENABLE_INSTRUCTIONS changes no bit there (it does on
# Intel, where MKL's AVX-512 kernels are what CI met); MKL_CBWR=COMPATIBLE changes MKL's GEMMs on
# any CPU; ATEN_CPU_CAPABILITY changes ATen's vectorised kernels (default: matmul and softmax too);
# RL_THREADS=2 gives each rank two intra-op threads instead of the suite's one. Each setting gets a
# fresh inductor cache: code compiled for one capability breaks under another (a NaN or a C++ error).
set -uo pipefail
cd "$(dirname "$0")/.."
declare -A SETTINGS=(
  [mkl-avx2]="MKL_ENABLE_INSTRUCTIONS=AVX2"
  [mkl-avx512]="MKL_ENABLE_INSTRUCTIONS=AVX512"
  [mkl-compatible]="MKL_CBWR=COMPATIBLE"
  [aten-default]="ATEN_CPU_CAPABILITY=default"
  [aten-avx2]="ATEN_CPU_CAPABILITY=avx2"
  [threads-2]="RL_THREADS=2"
)
ORDER=(mkl-avx2 mkl-avx512 mkl-compatible aten-default aten-avx2 threads-2)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=("${ORDER[@]}")
python=${PYTHON:-.venv/bin/python}
table="| setting | environment | result | seconds |\n|---|---|---|---|"
failed=0
for name in "${names[@]}"; do
  env_line=${SETTINGS[$name]:-}
  [ -n "$env_line" ] || { echo "unknown setting $name; the settings: ${ORDER[*]}"; exit 2; }
  cache=$(mktemp -d)
  log=$(mktemp)
  start=$(date +%s)
  echo "== $name ($env_line): pytest -m reordered"
  env $env_line TORCHINDUCTOR_CACHE_DIR="$cache" "$python" -m pytest -q -n 2 --dist loadgroup -m reordered tests \
    2>&1 | tee "$log" | tail -n 15
  code=${PIPESTATUS[0]}
  result=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -n 1 | sed -E 's/ in [0-9.]+s.*//; s/=//g; s/^ +//')
  table="$table\n| $name | $env_line | ${result:-no result (exit $code)} | $(( $(date +%s) - start )) |"
  [ "$code" -eq 0 ] || failed=1
  rm -rf "$cache" "$log"
done
echo -e "\n$table"
exit $failed
