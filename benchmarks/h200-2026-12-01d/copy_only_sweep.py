"""One-off (H200): split the CUDA kernel's gap to a copy between the rotation work and the rest.

Builds csrc/rope_kernels.cu twice with nvcc into shared libraries called through the C API
(rope_launch): as is, and a copy-only edit (no position/cos/sin loads, no math: every loaded
vector is stored unchanged; same grid, thread mapping, loads and stores). Times both on
W4's forward shape, W1 and W5 against a same-bytes copy, bench-style (CUDA graphs)."""
import ctypes
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from rope_ops import bench  # noqa: E402
import rope_ops  # noqa: E402

spec = importlib.util.spec_from_file_location("emu", ROOT / "tests" / "test_cuda_host_emulation.py")
emu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(emu)

src = (ROOT / "csrc" / "rope_kernels.cu").read_text()
copy_src, n1 = re.subn(r"if \(rot\) load_cos_sin<NC>\(p, pos_, \(long long\)c_ \* NC, cs, sn, on_the_fly\);",
                       "(void)0;", src)
copy_src, n2 = re.subn(r"\} else if \(NEOX\) \{\n\s+float x\[V\], y\[V\], xo\[V\], yo\[V\];.*?st_data<HINT>\(dst \+ half, pack16<T>\(yo\)\);\n",
                       "} else if (NEOX) {\n st_data<HINT>(dst, va[u]); st_data<HINT>(dst + half, vb[u]);\n",
                       copy_src, flags=re.S)
copy_src, n3 = re.subn(r"if \(rot\) pos = load_position\(p, ix\.b, ix\.s\);", "(void)0;", copy_src)
assert (n1, n2, n3) == (1, 1, 1), (n1, n2, n3)
libs = {}
procs = []
for name, text in (("as is", src), ("copy-only", copy_src)):
    cu = Path(f"/tmp/rope_{len(procs)}.cu")
    cu.write_text(text.replace('#include "rope_kernels.h"', f'#include "{ROOT}/csrc/rope_kernels.h"'))
    so = cu.with_suffix(".so")
    procs.append((name, so, subprocess.Popen(
        ["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-gencode=arch=compute_90,code=sm_90",
         "-Xptxas", "-v", str(cu), "-o", str(so)], stderr=subprocess.PIPE, text=True)))
for name, so, proc in procs:
    err = proc.communicate()[1]
    assert proc.returncode == 0, err[-3000:]
    lines = err.splitlines()
    for i, line in enumerate(lines):  # registers of the W1/W4/W5 kernel (bf16 neox pipe2 ld.cs+st.cs)
        if "Compiling entry" in line and "rope_fast_kernelI13__nv_bfloat16Lb1ELi1ELi2ELi2E" in line:
            print(name, "variant 4 bf16 neox:", next(l for l in lines[i:] if "registers" in l).strip())
    lib = ctypes.CDLL(str(so))
    lib.rope_launch.argtypes = [ctypes.POINTER(emu.RopeParams), ctypes.c_void_p, ctypes.c_void_p]
    lib.rope_launch.restype = ctypes.c_int
    libs[name] = lib


class Dev(ctypes.Structure):
    _fields_ = [("num_sms", ctypes.c_int), ("cc_major", ctypes.c_int)]


props = torch.cuda.get_device_properties(0)
dev = Dev(props.multi_processor_count, props.major)
bf16 = torch.bfloat16
bw = bench.copy_bandwidth(torch.device("cuda"))
print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

for label, tokens, hq, hk in (("W4 fwd", 8192, 32, 32), ("W5", 32768, 64, 8)):
    rope = rope_ops.RotaryEmbedding(128, base=500000.0, max_position=bench.TABLE_POSITIONS, device="cuda")
    cos, sin, ft = rope.tables(torch.device("cuda"))
    pos = torch.arange(4096, device="cuda").repeat(tokens // 4096)
    per_set = 2 * tokens * (hq + hk) * 128 * 2
    nsets = max(2, min(16, -(-bench.l2_bytes(torch.device("cuda")) * 3 // per_set)))
    sets = []
    for _ in range(nsets):
        q = torch.randn(tokens, hq, 128, device="cuda", dtype=bf16)
        k = torch.randn(tokens, hk, 128, device="cuda", dtype=bf16)
        sets.append((q, k, torch.empty_like(q), torch.empty_like(k)))
    params = [emu.params(q=q, k=k, q_out=qo, k_out=ko, layout="thd", rotary_dim=128, interleaved=False,
                         inplace=False, cos=cos, sin=sin, pos=pos, freq_turns=ft) for q, k, qo, ko in sets]
    pairs = [(torch.empty(per_set // 2, dtype=torch.uint8, device="cuda"),
              torch.empty(per_set // 2, dtype=torch.uint8, device="cuda")) for _ in range(nsets)]
    tc = min(bench.gpu_time_per_call([lambda a=a, b=b: b.copy_(a) for a, b in pairs]) * 1e6 for _ in range(2))
    q, k, qo, ko = sets[0]
    ref_q, _ = rope_ops.apply(q, k, pos, rope=rope, backend="cuda")
    for U in (1, 2, 3, 4, 6, 8, 12):
        line = f"{label:7s} max_heads {U:2d} copy {tc:8.2f} us"
        for name, lib in libs.items():
            lib.rope_set_config.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
            lib.rope_set_config(-1, U, -1)

            def call(p, lib=lib):
                rc = lib.rope_launch(ctypes.byref(p), ctypes.byref(dev), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                assert rc == 0, rc
            closures = [lambda p=p: call(p) for p in params]
            qo.zero_()
            closures[0]()
            torch.cuda.synchronize()
            same = torch.equal(qo, ref_q) if name == "as is" else torch.equal(qo, q)
            t = bench.gpu_time_per_call(closures) * 1e6
            line += f" | {name}: {t:8.2f} us ({t / tc:.3f} x copy; output check {same})"
        print(line, flush=True)
    del sets, pairs, params
    torch.cuda.empty_cache()
