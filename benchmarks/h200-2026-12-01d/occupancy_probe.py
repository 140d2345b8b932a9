"""One-off (H200): does capping resident blocks per SM (dynamic shared memory requested only to
limit occupancy) change the CUDA kernel's bandwidth? Builds csrc/rope_kernels.cu with the
launch's dynamic shared memory read from $ROPE_SMEM, calls it through rope_launch, times W4's
forward shape, W1, W5 and W3 out of place (class defaults otherwise) against a same-bytes copy."""
import ctypes
import importlib.util
import os
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
old = "  cfg.dynamicSmemBytes = 0;"
assert src.count(old) == 1
src = src.replace(old, """  {
    const char* env = getenv("ROPE_SMEM");
    const int smem = env ? atoi(env) : 0;
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cfg.dynamicSmemBytes = smem;
  }""")
src = src.replace("#include <string.h>", "#include <string.h>\n#include <stdlib.h>", 1)
cu = Path("/tmp/rope_occ.cu")
cu.write_text(src.replace('#include "rope_kernels.h"', f'#include "{ROOT}/csrc/rope_kernels.h"'))
so = cu.with_suffix(".so")
subprocess.run(["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared",
                "-gencode=arch=compute_90,code=sm_90", str(cu), "-o", str(so)], check=True)
lib = ctypes.CDLL(str(so))
lib.rope_launch.argtypes = [ctypes.POINTER(emu.RopeParams), ctypes.c_void_p, ctypes.c_void_p]
lib.rope_launch.restype = ctypes.c_int


class Dev(ctypes.Structure):
    _fields_ = [("num_sms", ctypes.c_int), ("cc_major", ctypes.c_int)]


props = torch.cuda.get_device_properties(0)
dev = Dev(props.multi_processor_count, props.major)
bf16 = torch.bfloat16
bw = bench.copy_bandwidth(torch.device("cuda"))
print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
# blocks of 128 (W4/W5 class) or 256 (W1) threads, 79 registers: 6 (128) / 3 (256) blocks per SM
# by registers; dynamic shared memory s caps them at floor(228 KB / (s + 1 KB)).
SMEM = [0, 36 * 1024, 44 * 1024, 56 * 1024, 75 * 1024, 112 * 1024]
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

    def call(p):
        rc = lib.rope_launch(ctypes.byref(p), ctypes.byref(dev),
                             ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        assert rc == 0, rc

    closures = [lambda p=p: call(p) for p in params]
    pairs = [(torch.empty(per_set // 2, dtype=torch.uint8, device="cuda"),
              torch.empty(per_set // 2, dtype=torch.uint8, device="cuda")) for _ in range(nsets)]
    tc = min(bench.gpu_time_per_call([lambda a=a, b=b: b.copy_(a) for a, b in pairs]) * 1e6 for _ in range(2))
    q, k, qo, ko = sets[0]
    ref_q, ref_k = rope_ops.apply(q, k, pos, rope=rope, backend="cuda")
    line = f"{label:7s} copy {tc:7.2f} us |"
    for smem in SMEM + [0]:
        os.environ["ROPE_SMEM"] = str(smem)
        qo.zero_()
        closures[0]()
        torch.cuda.synchronize()
        ok = torch.equal(qo, ref_q) and torch.equal(ko, ref_k)
        t = min(bench.gpu_time_per_call(closures) * 1e6 for _ in range(2))
        line += f" {smem // 1024}K {t:7.2f} ({t / tc:.3f}{'' if ok else ' WRONG'})"
    print(line, flush=True)
    del sets, pairs, params
    torch.cuda.empty_cache()
