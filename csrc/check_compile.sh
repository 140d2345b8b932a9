#!/usr/bin/env bash
# Compile check of the CUDA sources, no GPU needed.
#
#  1. every pure-CUDA csrc/*.cu with the machine's nvcc for sm_90 (ROPE_OPS_CHECK_ARCH overrides,
#     e.g. "90 100"), with the flags torch.utils.cpp_extension adds, printing ptxas's resource
#     report (-Xptxas -v) and a one-line-per-kernel summary; fails on any error, and on PTX in
#     which a kernel lacks its 16-byte loads and stores, position and cos/sin loads, or calls a
#     function;
#  2. tools/prologue_kernel_timing.cu (the prologue kernels' standalone timing) compiles;
#  3. a syntax-only check of csrc/rope_binding.cpp against the installed torch headers when a
#     Python with torch is found (PYTHON, else python3). A CPU-only torch lacks a few generated or
#     CUDA-library headers that the binding's includes pull in; stubs for exactly those are put
#     *after* the real include paths (-idirafter), so a CUDA torch uses its own headers.
#
# Usage: csrc/check_compile.sh            (exit status non-zero on failure)
# Env:   NVCC, ROPE_OPS_CHECK_ARCH, PYTHON, ROPE_OPS_SKIP_BINDING_CHECK=1
set -u -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nvcc="${NVCC:-}"
if [ -z "$nvcc" ]; then
  if command -v nvcc >/dev/null 2>&1; then nvcc="$(command -v nvcc)";
  elif [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then nvcc="$CUDA_HOME/bin/nvcc";
  elif [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc;
  else echo "check_compile: nvcc not found (set NVCC or CUDA_HOME)" >&2; exit 2; fi
fi
archs="${ROPE_OPS_CHECK_ARCH:-90}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "check_compile: $("$nvcc" --version | tail -1)"
status=0
# The defines torch.utils.cpp_extension passes to nvcc (the kernels must build with them).
torch_defs=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
            -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
            --expt-relaxed-constexpr)
shopt -s nullglob
for cu in "$here"/*.cu; do
  for a in $archs; do
    name="$(basename "$cu" .cu)"
    log="$tmp/$name.sm_$a.log"
    echo "== nvcc sm_$a $(basename "$cu")"
    keep="$tmp/keep.sm_$a"  # nvcc's intermediate files: the PTX it assembled, for the check below
    mkdir -p "$keep"
    if "$nvcc" -gencode="arch=compute_$a,code=sm_$a" -O3 -std=c++17 -Xcompiler -fPIC \
        "${torch_defs[@]}" -Xptxas -v -keep -keep-dir "$keep" -I"$here" -c "$cu" -o "$tmp/$name.sm_$a.o" >"$log" 2>&1; then
      cat "$log"
      # Summary: kernel (demangled where c++filt exists), registers, spills.
      awk '/Compiling entry function/ {match($0, /'"'"'[^'"'"']+'"'"'/); k=substr($0, RSTART+1, RLENGTH-2)}
           /bytes stack frame/ {sp=$0; sub(/^ +/, "", sp)}
           /Used [0-9]+ registers/ {match($0, /Used [0-9]+ registers/); print k "\t" substr($0, RSTART, RLENGTH) "\t" sp}' "$log" \
        | { if command -v c++filt >/dev/null 2>&1; then c++filt; else cat; fi; } \
        | sed -E 's/\(anonymous namespace\):://g; s/rope_ops_cuda:://g; s/\(RopeParams[^)]*\)//; s/, TableAngles>/>/' \
        > "$tmp/summary"
      echo "-- summary sm_$a:"
      sed 's/^/   /' "$tmp/summary"
      if grep -Eq '[1-9][0-9]* bytes spill' "$tmp/summary"; then
        echo "check_compile: WARNING: register spills in $(basename "$cu") for sm_$a" >&2
      fi
      # PTX sanity: every kernel still performs its memory accesses. (A self-recursive load
      # helper once let the compiler drop the position and cos/sin loads without a warning.)
      if cp "$keep/$name.ptx" "$tmp/$name.sm_$a.ptx" 2>>"$log"; then
        if ! awk '
          function check(   need, i, n, miss) {
            if (kern == "") return
            # heads kernels: template <T, NEOX, SCHED, ST, HINT, Angles, VB>; in the mangled name
            # "ELi<SCHED>ELi<ST>ELi<HINT>E": pipe2 (1, 2, 2) streams loads and stores, rounds4
            # (0, 4, 1) plain loads and stores, rounds1 (0, 1, 0) streams loads; VB "Li16E" moves
            # 16-byte vectors (v4), "Li8E" 8-byte ones (v2)
            w = (kern ~ /AnglesELi8E/) ? "v2" : "v4"
            # angle sources: positions and table rows (16-byte rows with 16-byte data vectors);
            # per-token cos/sin as float32 and 16-bit elements; mRoPE positions and single rows
            if (kern ~ /TokenAngles/) { angles = "ld.global.nc.f32 ld.global.nc.u16"; pos_cs = angles }
            else if (kern ~ /MropeAngles/) { angles = "ld.global.nc.s32 ld.global.nc.s64 ld.global.nc.f32"; pos_cs = angles }
            else { angles = "ld.global.nc.s32 ld.global.nc.s64"; pos_cs = angles (w == "v4" ? " ld.global.nc.v" : "") }
            if (kern ~ /rope_heads_kernel.*ELi1ELi2ELi2E/) n = split("ld.global.cs." w " st.global.cs." w " " pos_cs, need, " ")
            else if (kern ~ /rope_heads_kernel.*ELi0ELi4ELi1E/) n = split("ld.global." w " st.global." w " " pos_cs, need, " ")
            else if (kern ~ /rope_heads_kernel.*ELi0ELi1ELi0E/) n = split("ld.global.cs." w " st.global." w " " pos_cs, need, " ")
            else if (kern ~ /rope_heads_kernel/) { print "unknown heads kernel " kern; bad = 1; n = 0 }
            else if (kern ~ /rope_flat_(split_)?kernel/) n = split("ld.global.v4 st.global.v4 " pos_cs, need, " ")
            else if (kern ~ /rope_lean_kernel/) n = split("ld.global.v4 st.global.v4 " pos_cs, need, " ")
            else if (kern ~ /rope_rows_kernel/) n = split("ld.global.v4 st.global.cs.v4 " pos_cs, need, " ")
            # prologue kernels: template <T, NEOX, VB, U, Angles>; VB 16 ("Li16E") moves 16-byte
            # vectors of qkv and its outputs, with one unit per lane ("Li1E") staged by cp.async;
            # every one loads positions (and the forward slots)
            else if (kern ~ /rope_prologue(_backward)?_kernel.*ELi16ELi1E/) n = split("cp.async.cg.shared.global cp.async.wait_group st.global.v4 ld.global.nc.s32 ld.global.nc.s64", need, " ")
            else if (kern ~ /rope_prologue(_backward)?_kernel.*ELi16ELi[0-9]+E/) n = split("ld.global.v4 st.global.v4 ld.global.nc.s32 ld.global.nc.s64", need, " ")
            else if (kern ~ /rope_prologue(_backward)?_kernel/) n = split("ld.global.nc.s32 ld.global.nc.s64", need, " ")
            else if (kern ~ /rope_generic_kernel/) n = split(angles " ld.global.nc.f32 st.global", need, " ")
            else n = 0
            for (i = 1; i <= n; i++) if (index(body, need[i]) == 0) { print "missing " need[i] " in " kern; bad = 1 }
            if (kern ~ /rope_/ && kern !~ /weight_grad/ && body !~ /ld\.global\.nc(\.v[24])?\.f32/) { print "no cos/sin table load in " kern; bad = 1 }
            if (index(body, "call") != 0 && kern ~ /rope_/) { print "unexpected call in " kern; bad = 1 }
            # data moves as whole vectors only: nvcc once split a plain uint4 store into four
            # 32-bit stores in the flat kernel (3-4 % slower on the H200), with no warning
            if (kern ~ /rope_(heads|flat|flat_split|rows|lean)_kernel/ && body ~ /st\.global(\.wb|\.cs)?\.(u|b)32/) { print "32-bit stores in " kern; bad = 1 }
            kernels++
          }
          /^[.a-z ]*\.entry / { check(); kern = $0; body = ""; next }
          { body = body "\n" $0 }
          END { check(); if (kernels < 100) { print "only " kernels " kernels in the PTX"; bad = 1 } if (bad) exit 1; }' "$tmp/$name.sm_$a.ptx" >"$tmp/ptxcheck" 2>&1; then
          cat "$tmp/ptxcheck" >&2
          echo "check_compile: FAILED: PTX sanity check of $(basename "$cu") for sm_$a" >&2
          status=1
        else
          echo "-- PTX sanity (loads/stores present, no calls): OK"
        fi
      else
        cat "$log" >&2
        echo "check_compile: FAILED: PTX of $(basename "$cu") for sm_$a" >&2
        status=1
      fi
    else
      cat "$log" >&2
      echo "check_compile: FAILED: $(basename "$cu") for sm_$a" >&2
      status=1
    fi
  done
done

# the prologue kernels' standalone timing tool (tools/prologue_variants.sh builds it on a GPU)
timing="$here/../tools/prologue_kernel_timing.cu"
if [ -f "$timing" ]; then
  a="${archs%% *}"
  echo "== nvcc sm_$a tools/prologue_kernel_timing.cu"
  if ! "$nvcc" -gencode="arch=compute_$a,code=sm_$a" -O3 -std=c++17 "${torch_defs[@]}" -I"$here" \
      "$timing" -o "$tmp/prologue_kernel_timing" >"$tmp/timing.log" 2>&1; then
    cat "$tmp/timing.log" >&2
    echo "check_compile: FAILED: tools/prologue_kernel_timing.cu" >&2
    status=1
  fi
fi

if [ "${ROPE_OPS_SKIP_BINDING_CHECK:-0}" != 1 ] && [ -f "$here/rope_binding.cpp" ]; then
  py="${PYTHON:-python3}"
  if ! command -v "${CXX:-g++}" >/dev/null 2>&1; then
    echo "== rope_binding.cpp: skipped (no host C++ compiler ${CXX:-g++})"
  elif inc="$("$py" -c 'import sysconfig, torch.utils.cpp_extension as c; print("\n".join(c.include_paths() + [sysconfig.get_paths()["include"]]))' 2>/dev/null)"; then
    cuda_inc=""
    for c in "$(dirname "$(dirname "$(readlink -f "$nvcc")")")" "${CUDA_HOME:-}" /usr/local/cuda; do
      if [ -n "$c" ] && [ -f "$c/include/cuda_runtime.h" ]; then cuda_inc="$c/include"; break; fi
      if [ -n "$c" ] && [ -d "$c/targets" ]; then
        t="$(ls -d "$c"/targets/*/include 2>/dev/null | head -1)"
        if [ -n "$t" ] && [ -f "$t/cuda_runtime.h" ]; then cuda_inc="$t"; break; fi
      fi
    done
    stub="$tmp/stub"
    mkdir -p "$stub/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
    incs=()
    while IFS= read -r d; do [ -n "$d" ] && incs+=(-I"$d"); done <<<"$inc"
    echo "== g++ -fsyntax-only rope_binding.cpp (torch headers$( [ -f "$(echo "$inc" | head -1)/c10/cuda/impl/cuda_cmake_macros.h" ] || echo ', CPU-only torch: stubbed cuda_cmake_macros.h'))"
    if ${CXX:-g++} -std=c++20 -fsyntax-only "${incs[@]}" -I"$cuda_inc" -I"$here" -idirafter "$stub" \
        "$here/rope_binding.cpp" >"$tmp/binding.log" 2>&1; then
      echo "rope_binding.cpp: syntax OK"
    else
      grep -E 'error' "$tmp/binding.log" | head -40 >&2
      echo "check_compile: FAILED: rope_binding.cpp syntax check" >&2
      status=1
    fi
  else
    echo "== rope_binding.cpp: skipped (no torch in $py)"
  fi
fi

if [ "$status" = 0 ]; then echo "check_compile: OK"; fi
exit "$status"
