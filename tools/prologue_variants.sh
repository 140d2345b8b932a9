#!/usr/bin/env bash
# Times variants of the fused prologue's CUDA kernels in one run on a GPU: each variant is
# tools/prologue_kernel_timing.cu built against a copy of csrc/ with the staging constants (and
# optionally __launch_bounds__ minimum blocks per SM and the backward's grid blocks per SM)
# changed, or against another revision's
# csrc/. Prints each variant's times, its same-bytes copy and its output hash (equal hashes: the
# same bits; a revision without the weight-gradient kernel hashes the training case differently).
#
#   bash tools/prologue_variants.sh                       # the stage sweep below
#   bash tools/prologue_variants.sh NAME:FWD:BWD[:FWD_MINB:BWD_MINB[:BWD_GRID_PER_SM]] ...
#   BASE=<git revision or directory>[,...] bash tools/prologue_variants.sh
#                                                         # also those revisions' (or csrc
#                                                         # copies') kernels, first
#
# Env: NVCC, ROPE_OPS_CUDA_ARCH (default 90), PT_CASE (one case).
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc="${NVCC:-nvcc}"
arch="${ROPE_OPS_CUDA_ARCH:-90}"
flags=(-gencode="arch=compute_$arch,code=sm_$arch" -O3 -std=c++17 -D__CUDA_NO_HALF_OPERATORS__
       -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       --expt-relaxed-constexpr)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
specs=("$@")
[ "${#specs[@]}" -eq 0 ] && specs=(current:2:2 f3_b2:3:2 f4_b4:4:4 f2_b3:2:3 f2_b4:2:4 f0_b0:0:0)

build() {  # name src_dir extra_flags...
  local name=$1 dir=$2; shift 2
  "$nvcc" "${flags[@]}" "$@" -I"$dir" tools/prologue_kernel_timing.cu -o "$work/$name" > "$work/$name.log" 2>&1 ||
    { echo "== $name: build failed"; tail -5 "$work/$name.log"; }
}

names=()
for spec in "${specs[@]}"; do
  IFS=: read -r name fwd bwd fmin bmin bgrid <<< "$spec"
  dir="$work/src_$name"
  cp -r csrc "$dir"
  sed -i "s/kPrologueForwardStages = [0-9]*/kPrologueForwardStages = $fwd/; s/kPrologueBackwardStages = [0-9]*/kPrologueBackwardStages = $bwd/" "$dir/kernel_prologue.cuh"
  if [ -n "${bgrid:-}" ]; then
    sed -i "s/kPrologueBackwardBlocksPerSm = [0-9]*/kPrologueBackwardBlocksPerSm = $bgrid/" "$dir/kernel_prologue.cuh"
  fi
  if [ -n "${fmin:-}" ] && [ "$fmin" != 0 ]; then
    perl -0pi -e "s/__launch_bounds__\(kPrologueThreads\)\n    rope_prologue_kernel/__launch_bounds__(kPrologueThreads, $fmin)\n    rope_prologue_kernel/" "$dir/kernel_prologue.cuh"
  fi
  if [ -n "${bmin:-}" ] && [ "$bmin" != 0 ]; then
    perl -0pi -e "s/__launch_bounds__\(kPrologueThreads\)\n    rope_prologue_backward_kernel/__launch_bounds__(kPrologueThreads, $bmin)\n    rope_prologue_backward_kernel/" "$dir/kernel_prologue.cuh"
  fi
  build "$name" "$dir" &
  names+=("$name")
done
bases=()
[ -n "${BASE:-}" ] && IFS=, read -r -a bases <<< "$BASE"
base_names=()
for base in "${bases[@]}"; do
  name="base_$(basename "$base")"
  dir="$work/src_$name"
  mkdir -p "$dir"
  if [ -d "$base" ]; then  # a copy of csrc/ (a machine without the repository's history)
    cp -r "$base"/. "$dir"
  else
    git archive "$base" csrc | tar -x -C "$dir" --strip-components=1
  fi
  extra=()
  grep -q rope_prologue_weight_grad_kernel "$dir/kernel_prologue.cuh" || extra=(-DPT_NO_WEIGHT_GRAD)
  build "$name" "$dir" "${extra[@]}" &
  base_names+=("$name")
done
names=("${base_names[@]}" "${names[@]}")
wait
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null || true
for name in "${names[@]}"; do
  [ -x "$work/$name" ] || continue
  echo "== $name"
  "$work/$name" || echo "== $name: exit $?"
done
