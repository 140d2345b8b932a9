"""The Triton kernel compiles for a real GPU (sm_90), without one: triton's bundled ptxas.

The interpreter (tests/test_triton_backend.py) runs the kernel as Python and misses what only
the compiler rejects. This compiles, for sm_90, the kernel variants the launch policy picks for
PERF.md's workloads and for the classes of shape it has rules for (head_dim 80/96/112 in
pieces, fp32, MQA, partial rotary in and out of place, bhsd, few-token decode), plus a few odd
ones, and checks that q/k accesses of dense bf16/fp16/fp32 heads are 16-byte vectors and that
nothing spills. Runs in a subprocess without TRITON_INTERPRET (the variable changes what
@triton.jit builds). ``python tests/test_triton_compile.py`` prints registers per variant.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(r'''
    import re, subprocess, sys, tempfile, torch, triton
    from pathlib import Path
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    try:
        import rope_ops_backends.triton_backend as tb
    except ImportError:
        import importlib
        sys.modules["rope_ops_backends"] = importlib.import_module("backends")
        import rope_ops_backends.triton_backend as tb
    from rope_ops.backend import KernelArgs

    H200 = tb.DeviceInfo(sm_count=132)
    TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}
    kern = tb._kernels()["kernels"]
    fn = kern.rope_kernel
    NOSPEC = ("n_tokens", "seq_len", "n_rows", "pos_offset")

    def compile_for(args, cfg):
        """Compile the variant run() would launch, specialized as triton's JIT would."""
        launch = tb._make_launch(args, cfg, kern.libdevice is not None)
        values = launch.arguments(
            args.q, args.q if args.k is None else args.k, args.q_out,
            args.q_out if args.k_out is None else args.k_out,
            *tb._angle_pointers(args.pos, args.cos, args.sin, args.freq_turns), 0, 1.0)
        constexprs = {n for n, p in zip(fn.arg_names, fn.params) if p.is_constexpr}
        sig, cx, attrs = {}, {}, {}
        for i, (n, v) in enumerate(zip(fn.arg_names, values)):
            if n in constexprs:
                sig[n], cx[(i,)] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[n] = "*" + TY[v.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, float):
                sig[n] = "fp32"
            elif n in NOSPEC:
                sig[n] = "i32"
            elif v == 1:
                sig[n], cx[(i,)] = "constexpr", 1
            else:
                sig[n] = "i32"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.num_warps})

    def make(layout, B, S, hq, hk, D, R, style="neox", dtype=torch.bfloat16, pos="none",
             inplace=False, caller=False, inverse=False, stride2=False):
        shape = {"bshd": lambda h: (B, S, h, D), "thd": lambda h: (B * S, h, D),
                 "sbhd": lambda h: (S, B, h, D), "bhsd": lambda h: (B, h, S, D)}[layout]
        if stride2:
            q = torch.empty(*shape(hq)[:-1], 2 * D, dtype=dtype)[..., ::2]
            k = torch.empty(*shape(hk)[:-1], 2 * D, dtype=dtype)[..., ::2]
        else:
            q, k = torch.empty(shape(hq), dtype=dtype), torch.empty(shape(hk), dtype=dtype)
        if hk == 0:
            k = None
        p = None
        if pos == "bs":
            p = torch.zeros(B * S if layout == "thd" else (B, S), dtype=torch.int64)
        elif pos == "i32":
            p = torch.zeros(S, dtype=torch.int32)
        cos = torch.empty(64, R // 2)
        return KernelArgs(q=q, k=k, q_out=q if inplace else torch.empty_like(q),
                          k_out=k if inplace or k is None else torch.empty_like(k), pos=p,
                          pos_offset=0, cos=cos, sin=cos,
                          freq_turns=None if caller else torch.empty(R // 2, dtype=torch.int64),
                          attention_factor=1.0, layout=layout, rotary_dim=R,
                          interleaved=style == "gptj", inverse=inverse, inplace=inplace)

    # name: (args, must be 16-byte vectors)
    cases = {
        "W1": (make("bshd", 4, 4096, 32, 8, 128, 128), True),
        "W2": (make("thd", 1, 256, 32, 8, 128, 128, pos="bs"), True),
        "W3 in place": (make("bshd", 2, 4096, 16, 16, 256, 64, "gptj", inplace=True), True),
        "W3": (make("bshd", 2, 4096, 16, 16, 256, 64, "gptj"), True),
        "W4 bwd": (make("bshd", 2, 4096, 32, 32, 128, 128, inverse=True), True),
        "W5": (make("bshd", 8, 4096, 64, 8, 128, 128), True),
        "decode 1 token": (make("thd", 1, 1, 32, 8, 128, 128, pos="bs"), False),
        "hd80 partial (Phi-2)": (make("bshd", 4, 2048, 32, 32, 80, 32), True),
        "hd96 (Phi-3)": (make("bshd", 4, 2048, 32, 32, 96, 96), True),
        "hd112 gptj": (make("bshd", 4, 2048, 16, 4, 112, 112, "gptj"), True),
        "fp32 training": (make("bshd", 2, 4096, 32, 8, 128, 128, dtype=torch.float32), True),
        "fp16 MQA hd64": (make("bshd", 8, 2048, 71, 1, 64, 64, dtype=torch.float16), True),
        "bhsd GQA": (make("bhsd", 4, 2048, 28, 4, 128, 128), True),
        "sbhd hd256": (make("sbhd", 2, 4096, 16, 8, 256, 256), True),
        "NeoX partial in place hd96 r24": (make("bshd", 4, 2048, 32, 32, 96, 24, inplace=True), False),
        "fp32 sbhd caller int32": (make("sbhd", 2, 64, 4, 1, 64, 32, "gptj", torch.float32,
                                        pos="i32", caller=True), False),
        "fp16 bhsd stride-2 dims": (make("bhsd", 2, 64, 4, 2, 64, 64, "neox", torch.float16,
                                         stride2=True), False),
    }
    CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def resources(ck):
        """(registers, local memory bytes) of the cubin (triton reads them only when loading it
        on a GPU; spills show as local memory)."""
        if not CUOBJDUMP.exists():
            return -1, 0
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name],
                                 capture_output=True, text=True).stdout
        regs = re.search(r"REG:(\d+)", out)
        local = re.search(r"LOCAL:(\d+)", out)
        return int(regs[1]) if regs else -1, int(local[1]) if local else 0

    only = sys.argv[1:]
    bad = []
    for name, (args, vector) in cases.items():
        if only and name not in only:
            continue
        cfg = tb.launch_policy(tb.shape_of(args), H200)
        ck = compile_for(args, cfg)
        ptx = ck.asm["ptx"]
        v4 = len(re.findall(r"(?:ld|st)\.global(?:\.[\w:]+)*\.v4\.b32", ptx))
        narrow = len(re.findall(r"(?:ld|st)\.global(?:\.[\w:]+)*\.(?:b16|v2\.b16|v4\.b16)\b", ptx))
        regs, spills = resources(ck)
        print(f"{name:32s} {cfg.label():22s} regs {regs:3d} local {spills} "
              f"16-byte accesses {v4} 2-byte {narrow}")
        if spills or (vector and (v4 == 0 or narrow)):
            bad.append(name)
    print("PROBLEMS:", bad if bad else "none")
    sys.exit(1 if bad else 0)
''')


def _ptxas_present() -> bool:
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def run_script(*names: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    return subprocess.run([sys.executable, "-c", SCRIPT, *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(not _ptxas_present(), reason="triton's bundled ptxas not present")
def test_kernel_compiles_for_sm90_with_vector_accesses():
    r = run_script()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


if __name__ == "__main__":
    result = run_script(*sys.argv[1:])
    print(result.stdout, result.stderr[-4000:])
    sys.exit(result.returncode)
