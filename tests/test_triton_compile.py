"""The Triton kernel compiles for a real GPU (sm_90), without one: triton's bundled ptxas.

The interpreter (tests/test_triton_backend.py) runs the kernel as Python and misses what only
the compiler rejects (it once accepted a non-constexpr global). This compiles the PERF.md
workload variants and a few odd ones for sm_90 and checks that q/k accesses are 16-byte vectors.
Runs in a subprocess without TRITON_INTERPRET (the variable changes what @triton.jit builds).
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
    import re, sys, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    try:
        import rope_ops_backends.triton_backend as tb
    except ImportError:
        import importlib
        sys.modules["rope_ops_backends"] = importlib.import_module("backends")
        import rope_ops_backends.triton_backend as tb
    from rope_ops.backend import KernelArgs

    TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}
    CONSTS = ("HQ", "HK", "HEAD_DIM", "ROTARY_DIM", "HALF_P", "PASS_P", "BLOCK_T", "BLOCK_H",
              "INTERLEAVED", "INVERSE", "COPY_PASS", "HAS_POS", "HAS_TURNS", "D_CONTIG",
              "LIBDEVICE", "EARLY", "HEAD_GRID", "TOK_SPLIT", "STREAM", "PDL")
    INTS = ("n_tokens", "seq_len", "n_rows", "sq_b", "sq_s", "sq_h", "sq_d", "sk_b", "sk_s",
            "sk_h", "sk_d", "sqo_b", "sqo_s", "sqo_h", "sqo_d", "sko_b", "sko_s", "sko_h",
            "sko_d", "sp_b", "sp_s")
    NOSPEC = ("n_tokens", "seq_len", "n_rows", "pos_offset")
    kern = tb.TritonBackend()._get_kernel()
    fn = kern.rope_kernel

    def compile_for(args):
        """Compile the variant run(args) would launch, specialized as triton's JIT would."""
        plan = tb.TritonBackend()._make_plan(args)
        consts = dict(zip(CONSTS, plan.consts))
        consts["LIBDEVICE"] = kern.libdevice is not None
        ints = dict(zip(INTS, plan.ints))
        cos, turns, pos = args.cos, args.freq_turns, args.pos
        ptrs = {"q_ptr": args.q, "k_ptr": args.q if args.k is None else args.k,
                "qo_ptr": args.q_out, "ko_ptr": args.q_out if args.k_out is None else args.k_out,
                "pos_ptr": cos if pos is None else pos, "cos_ptr": cos, "sin_ptr": cos,
                "turns_ptr": cos if turns is None else turns}
        sig, cx, attrs = {}, {}, {}
        for i, n in enumerate(fn.arg_names):
            if n in consts:
                sig[n], cx[(i,)] = "constexpr", consts[n]
            elif n in ptrs:
                sig[n], attrs[(i,)] = "*" + TY[ptrs[n].dtype], [["tt.divisibility", 16]]
            elif n == "attn_factor":
                sig[n] = "fp32"
            elif n in NOSPEC:
                sig[n] = "i32"
            elif ints[n] == 1:
                sig[n], cx[(i,)] = "constexpr", 1
            else:
                sig[n] = "i32"
                if ints[n] % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": plan.num_warps})

    def make(layout, B, S, hq, hk, D, R, style, dtype=torch.bfloat16, pos="none", inplace=False,
             caller=False, inverse=False, stride2=False):
        shape = {"bshd": lambda h: (B, S, h, D), "thd": lambda h: (B * S, h, D),
                 "sbhd": lambda h: (S, B, h, D), "bhsd": lambda h: (B, h, S, D)}[layout]
        if stride2:
            q = torch.empty(*shape(hq)[:-1], 2 * D, dtype=dtype)[..., ::2]
            k = torch.empty(*shape(hk)[:-1], 2 * D, dtype=dtype)[..., ::2]
        else:
            q, k = torch.empty(shape(hq), dtype=dtype), torch.empty(shape(hk), dtype=dtype)
        p = None
        if pos == "bs":
            p = torch.zeros(B * S if layout == "thd" else (B, S), dtype=torch.int64)
        elif pos == "i32":
            p = torch.zeros(S, dtype=torch.int32)
        cos = torch.empty(64, R // 2)
        return KernelArgs(q=q, k=k, q_out=q if inplace else torch.empty_like(q),
                          k_out=k if inplace else torch.empty_like(k), pos=p, pos_offset=0,
                          cos=cos, sin=cos, freq_turns=None if caller else torch.empty(R // 2,
                          dtype=torch.int64), attention_factor=1.0, layout=layout,
                          rotary_dim=R, interleaved=style == "gptj", inverse=inverse,
                          inplace=inplace)

    cases = {
        "W1": make("bshd", 4, 4096, 32, 8, 128, 128, "neox"),
        "W2": make("thd", 1, 256, 32, 8, 128, 128, "neox", pos="bs"),
        "W3 in place": make("bshd", 2, 4096, 16, 16, 256, 64, "gptj", inplace=True),
        "W3": make("bshd", 2, 4096, 16, 16, 256, 64, "gptj"),
        "W4 bwd": make("bshd", 2, 4096, 32, 32, 128, 128, "neox", inverse=True),
        "W5": make("bshd", 8, 4096, 64, 8, 128, 128, "neox"),
        "fp32 sbhd caller int32": make("sbhd", 2, 64, 4, 1, 64, 32, "gptj", torch.float32,
                                       pos="i32", caller=True),
        "fp16 bhsd stride-2 dims": make("bhsd", 2, 64, 4, 2, 64, 64, "neox", torch.float16,
                                        stride2=True),
    }
    vectorized = ("W1", "W2", "W3 in place", "W4 bwd", "W5")
    bad = []
    for name, args in cases.items():
        ptx = compile_for(args).asm["ptx"]
        v4 = len(re.findall(r"(?:ld|st)\.global(?:\.[\w:]+)*\.v4\.b32", ptx))
        scalar16 = len(re.findall(r"(?:ld|st)\.global(?:\.[\w:]+)*\.b16", ptx))
        print(f"{name}: {v4} 16-byte accesses, {scalar16} 2-byte accesses")
        if name in vectorized and (v4 == 0 or scalar16):
            bad.append(name)
    print("NOT VECTORIZED:", bad if bad else "none")
    sys.exit(1 if bad else 0)
''')


def _ptxas_present() -> bool:
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _ptxas_present(), reason="triton's bundled ptxas not present")
def test_kernel_compiles_for_sm90_with_vector_accesses():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
