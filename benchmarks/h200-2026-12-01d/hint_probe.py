"""One-off (H200): cache hints on the CUDA kernel's q/k data loads (ld_stream, used by the
W1/W4/W5 class variant; W3 out of place uses plain loads and is the control). Builds
csrc/rope_kernels.cu once per hint, calls it through rope_launch, times against a same-bytes
copy and checks the outputs against the extension's."""
import ctypes
import importlib.util
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
old = "  return __ldcs(ptr);"
assert src.count(old) == 1
ASM = '''  static_assert(sizeof(T) == 16, "uint4 loads only");
  uint4 v;
  asm volatile("%s {%%0, %%1, %%2, %%3}, [%%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;'''
hints = {"ld.global.cs (as is)": None,
         "ld.global.cs.L2::256B": "ld.global.cs.L2::256B.v4.u32",
         "ld.global.nc.L1::no_allocate": "ld.global.nc.L1::no_allocate.v4.u32",
         "ld.global.nc.L1::no_allocate.L2::256B": "ld.global.nc.L1::no_allocate.L2::256B.v4.u32"}
procs = []
for i, (name, insn) in enumerate(hints.items()):
    text = src if insn is None else src.replace(old, ASM % insn)
    cu = Path(f"/tmp/rope_hint{i}.cu")
    cu.write_text(text.replace('#include "rope_kernels.h"', f'#include "{ROOT}/csrc/rope_kernels.h"'))
    procs.append((name, cu.with_suffix(".so"), subprocess.Popen(
        ["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-gencode=arch=compute_90,code=sm_90",
         str(cu), "-o", str(cu.with_suffix(".so"))], stderr=subprocess.PIPE, text=True)))
libs = {}
for name, so, proc in procs:
    err = proc.communicate()[1]
    assert proc.returncode == 0, err[-3000:]
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
cases = [("W4 fwd", 8192, 32, 32, 128, 128, False), ("W1", 16384, 32, 8, 128, 128, False),
         ("W5", 32768, 64, 8, 128, 128, False), ("W3 oop", 8192, 16, 16, 256, 64, True)]
for label, tokens, hq, hk, D, r, gptj in cases:
    rope = rope_ops.RotaryEmbedding(D, rotary_dim=r, base=10000.0 if gptj else 500000.0,
                                    max_position=bench.TABLE_POSITIONS, style="gptj" if gptj else "neox",
                                    device="cuda")
    cos, sin, ft = rope.tables(torch.device("cuda"))
    pos = torch.arange(4096, device="cuda").repeat(tokens // 4096)
    per_set = 2 * tokens * (hq + hk) * D * 2
    nsets = max(2, min(16, -(-bench.l2_bytes(torch.device("cuda")) * 3 // per_set)))
    sets = []
    for _ in range(nsets):
        q = torch.randn(tokens, hq, D, device="cuda", dtype=bf16)
        k = torch.randn(tokens, hk, D, device="cuda", dtype=bf16)
        sets.append((q, k, torch.empty_like(q), torch.empty_like(k)))
    params = [emu.params(q=q, k=k, q_out=qo, k_out=ko, layout="thd", rotary_dim=r, interleaved=gptj,
                         inplace=False, cos=cos, sin=sin, pos=pos, freq_turns=ft) for q, k, qo, ko in sets]
    pairs = [(torch.empty(per_set // 2, dtype=torch.uint8, device="cuda"),
              torch.empty(per_set // 2, dtype=torch.uint8, device="cuda")) for _ in range(nsets)]
    tc = min(bench.gpu_time_per_call([lambda a=a, b=b: b.copy_(a) for a, b in pairs]) * 1e6 for _ in range(2))
    q, k, qo, ko = sets[0]
    ref_q, ref_k = rope_ops.apply(q, k, pos, rope=rope, backend="cuda")
    line = f"{label:7s} copy {tc:7.2f} us |"
    for rep in range(2):
        for name, lib in libs.items():
            def call(p, lib=lib):
                rc = lib.rope_launch(ctypes.byref(p), ctypes.byref(dev),
                                     ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                assert rc == 0, rc
            closures = [lambda p=p: call(p) for p in params]
            qo.zero_()
            closures[0]()
            torch.cuda.synchronize()
            ok = torch.equal(qo, ref_q) and torch.equal(ko, ref_k)
            t = bench.gpu_time_per_call(closures) * 1e6
            line += f" {name}: {t:7.2f} ({t / tc:.3f}{'' if ok else ' WRONG'});"
        line += "\n" + " " * 26
    print(line, flush=True)
    del sets, pairs, params
    torch.cuda.empty_cache()
