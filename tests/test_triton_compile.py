"""The Triton kernel compiles for a real GPU (sm_90), without one: triton's bundled ptxas.

The interpreter (tests/test_triton_backend.py) runs the kernel as Python and misses what only
the compiler rejects. This compiles, for sm_90, the kernel variants the launch policy picks for
PERF.md's workloads and for the classes of shape it has rules for (head_dim 80/96/112 in
pieces, fp32, MQA, partial rotary in and out of place, bhsd, few-token decode), plus a few odd
ones, the angle variants (per-token cos/sin, mRoPE) and the fused prologue's forward (QK-norm,
KV-cache writes in bf16 and float8, a float8 q) and backward, and checks that q/k accesses of dense
bf16/fp16/fp32 heads are 16-byte vectors (8-byte where a policy gives each thread 8 bytes) and
that nothing spills. Runs in a subprocess without TRITON_INTERPRET (the variable changes what
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
    from rope_ops.backend import KernelArgs, PrologueArgs
    from rope_ops_backends.triton_backend import prologue as tp

    H200 = tb.DeviceInfo(sm_count=132)
    TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
    kern = tb._kernels()["kernels"]
    NOSPEC = ("n_tokens", "seq_len", "n_rows", "pos_offset", "n_slots")

    def compile_for(args, cfg):
        """Compile the variant run() would launch, specialized as triton's JIT would."""
        launch = tb._make_launch(args, cfg, kern.libdevice is not None)
        values = launch.arguments(
            args.q, args.q if args.k is None else args.k, args.q_out,
            args.q_out if args.k_out is None else args.k_out,
            *tb._angle_pointers(args.pos, args.cos, args.sin, args.freq_turns), 0, 1.0)
        return compile_values(kern.rope_kernel, values, {"num_warps": launch.num_warps})

    def compile_values(fn, values, options):
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
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    def make(layout, B, S, hq, hk, D, R, style="neox", dtype=torch.bfloat16, pos="none",
             inplace=False, caller=False, inverse=False, stride2=False, angles="table"):
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
        section = None
        if angles in ("token", "token bf16"):  # the caller's rows, broadcast over the batch
            table = torch.bfloat16 if angles == "token bf16" else torch.float32
            cos = torch.empty(1, S, R // 2, dtype=table).expand(B, S, R // 2)
            p, caller, angles = None, True, "token"
        elif angles == "mrope":
            p = torch.zeros(3, B * S if layout == "thd" else S, dtype=torch.int64)
            section = (R // 2 - 2 * (R // 6), R // 6, R // 6)
        return KernelArgs(q=q, k=k, q_out=q if inplace else torch.empty_like(q),
                          k_out=k if inplace or k is None else torch.empty_like(k), pos=p,
                          pos_offset=0, cos=cos, sin=cos,
                          freq_turns=None if caller else torch.empty(R // 2, dtype=torch.int64),
                          attention_factor=1.0, layout=layout, rotary_dim=R,
                          interleaved=style == "gptj", inverse=inverse, inplace=inplace,
                          angles=angles, mrope_section=section, mrope_interleaved=style == "gptj")

    def prologue(T, hq, hk, D, R=None, style="neox", dtype=torch.bfloat16, norm=True,
                 inplace=False, cache=None, batch=None, rotate=True, angles="table", q_scale=0.0):
        """PrologueArgs of a [T, W] (or [batch, T / batch, W]) call: positions, float32 weights;
        q_scale: q out in float8."""
        R = D if R is None else R
        lead = (T,) if batch is None else (batch, T // batch)
        qkv = torch.empty(*lead, (hq + 2 * hk) * D, dtype=dtype)
        outs = [None if inplace else torch.empty(*lead, h, D, dtype=t)
                for h, t in ((hq, torch.float8_e4m3fn if q_scale else dtype), (hk, dtype),
                             (hk, dtype))]
        kc = vc = slots = None
        if cache is not None:
            kc = torch.empty(4096, hk, D, dtype=cache)
            vc = torch.empty(4096, hk, D, dtype=cache)
            slots = torch.zeros(lead, dtype=torch.int64)
        w = torch.empty(D) if norm else None
        pos = torch.zeros(lead, dtype=torch.int64) if rotate else None
        cos = torch.empty(64, R // 2)
        turns = torch.empty(R // 2, dtype=torch.int64)
        section = None
        if angles == "mrope":
            pos = torch.zeros(3, *lead, dtype=torch.int64)
            section = (R // 2 - 2 * (R // 6), R // 6, R // 6)
        elif angles == "token":  # Hugging Face's bf16 rows, shared by the batch
            b, s = (1, T) if batch is None else (batch, T // batch)
            cos = torch.empty(1, s, R // 2, dtype=torch.bfloat16).expand(b, s, R // 2)
            pos = turns = None
        return PrologueArgs(
            qkv=qkv, q_out=outs[0], k_out=outs[1], v_out=outs[2], pos=pos, pos_offset=0,
            cos=cos, sin=cos, freq_turns=turns, attention_factor=1.0,
            layout="thd" if batch is None else "bshd", num_q_heads=hq, num_kv_heads=hk,
            head_dim=D, rotary_dim=R, interleaved=style == "gptj", rotate=rotate, q_weight=w,
            k_weight=w, eps=1e-6, weight_offset=0.0, inplace=inplace, k_cache=kc, v_cache=vc,
            slots=slots, k_scale=1.0, v_scale=1.0, angles=angles, mrope_section=section,
            mrope_interleaved=True, q_scale=q_scale)

    def compile_prologue(pargs, backward):
        """Compile the prologue variant run_prologue(_backward) would launch (the policy's
        configuration for the H200 or the backward's, the register cap)."""
        if backward:
            label = tp.backward_config(pargs).label()
            g = [torch.empty(*pargs.qkv.shape[:-1], h, pargs.head_dim, dtype=pargs.qkv.dtype)
                 for h in (pargs.num_q_heads, pargs.num_kv_heads, pargs.num_kv_heads)]
            launch = tp.backward_launch(pargs, *g)
            fn = tb._kernels()["prologue_kernels"].prologue_backward_kernel
        else:
            label = tb.launch_policy(tp.prologue_shape(pargs), H200,
                                     rules=tp.PROLOGUE_RULES).label()
            launch = tp.forward_launch(pargs, label)
            fn = tb._kernels()["prologue_kernels"].prologue_kernel
        return label, compile_values(fn, launch.arguments, launch.options())

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
        "per-token cos/sin W1": (make("bshd", 4, 4096, 32, 8, 128, 128, angles="token"), True),
        # bf16 rows (Hugging Face's dtype): the [4, 64] row tile is one element per thread
        "per-token bf16 cos/sin W1": (make("bshd", 4, 4096, 32, 8, 128, 128,
                                           angles="token bf16"), False),
        "mRoPE Qwen2-VL": (make("bshd", 2, 4096, 28, 4, 128, 128, angles="mrope"), True),
        "mRoPE interleaved thd": (make("thd", 1, 8192, 32, 8, 128, 128, "gptj", angles="mrope"),
                                  True),
    }
    # name: (PrologueArgs, backward, the narrowest vector its q/k accesses may use in bytes; 0: any)
    prologue_cases = {
        "prologue prefill QK-norm": (prologue(16384, 32, 8, 128), False, 16),
        "prologue training fwd": (prologue(8192, 32, 8, 128, batch=2), False, 16),
        # one token per block at 4 warps: 8 bytes a thread (timed faster than 16: backward_config)
        "prologue training bwd": (prologue(8192, 32, 8, 128, batch=2), True, 8),
        # 47 KiB a stage: at 4 warps the per-warp budget stages one (2 stages)
        "prologue training bwd hd256": (prologue(4096, 32, 8, 256, batch=2), True, 16),
        "prologue decode bf16 cache": (prologue(64, 32, 8, 128, cache=torch.bfloat16), False,
                                       16),
        "prologue decode fp8 cache": (prologue(64, 32, 8, 128, cache=torch.float8_e4m3fn),
                                      False, 16),
        "prologue in place gptj hd80 r32": (prologue(4096, 16, 4, 80, 32, "gptj", inplace=True),
                                            False, 16),
        "prologue decode fp8 cache gptj": (prologue(64, 32, 8, 128, style="gptj",
                                                    cache=torch.float8_e4m3fn), False, 16),
        "prologue mRoPE interleaved": (prologue(4096, 32, 8, 128, angles="mrope"), False, 16),
        "prologue prefill fp8 q": (prologue(16384, 32, 8, 128, q_scale=0.5), False, 16),
        "prologue decode fp8 q and cache": (prologue(64, 32, 8, 128, cache=torch.float8_e4m3fn,
                                                     q_scale=0.5), False, 16),
        # bf16 rows: the [4, 64] row tile is one element per thread (2-byte loads)
        "prologue per-token bwd": (prologue(4096, 32, 8, 128, batch=2, angles="token"), True,
                                   0),
        "prologue norm only fp32": (prologue(4096, 16, 16, 64, rotate=False,
                                             dtype=torch.float32), False, 16),
        # k/v chunks of 2 heads: the 16-pair piece is one element per thread
        "prologue bwd hd96 rope only": (prologue(4096, 8, 2, 96, norm=False), True, 0),
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

    def report(name, label, ck, min_bytes):
        """Print the variant's registers and accesses; note it in ``bad`` if it spills or, where
        ``min_bytes`` asks for vectors, has no global access that wide or any 2-byte one."""
        ptx = ck.asm["ptx"]
        # vector loads and stores, and asynchronous copies (a software-pipelined loop's reads)
        def wide(nbytes):
            vec = "v4" if nbytes == 16 else "v2"
            return len(re.findall(rf"(?:ld|st)\.global(?:\.[\w:]+)*\.{vec}\.b32", ptx)) + len(
                re.findall(rf"cp\.async\.c[ag]\.shared\.global(?:\.[\w:]+)* \[[^]]+\], \[[^]]+\], "
                           rf"0x{nbytes:x}\b", ptx))
        v4, v2 = wide(16), wide(8)
        narrow = len(re.findall(r"(?:ld|st)\.global(?:\.[\w:]+)*\.(?:b16|v2\.b16|v4\.b16)\b", ptx))
        regs, spills = resources(ck)
        print(f"{name:32s} {label:22s} regs {regs:3d} local {spills} "
              f"16-byte accesses {v4} 8-byte {v2} 2-byte {narrow}")
        enough = v4 + (v2 if min_bytes <= 8 else 0)
        if spills or (min_bytes and (enough == 0 or narrow)):
            bad.append(name)

    only = sys.argv[1:]
    bad = []
    for name, (args, vector) in cases.items():
        if only and name not in only:
            continue
        cfg = tb.launch_policy(tb.shape_of(args), H200)
        report(name, cfg.label(), compile_for(args, cfg), 16 if vector else 0)
    for name, (pargs, backward, min_bytes) in prologue_cases.items():
        if only and name not in only:
            continue
        label, ck = compile_prologue(pargs, backward)
        report(name, label, ck, min_bytes)
        if backward:  # the stage budget's estimate, with its reserve, bounds what it takes
            cfg = tb.parse_label(label)
            stages = tp.backward_stages(pargs, cfg, tp.BACKWARD_STAGES, device=H200)
            staged = (stages - 1) * tp.staged_bytes(pargs, cfg)
            print(f"{'':32s} shared memory {ck.metadata.shared} for {staged} staged")
            if ck.metadata.shared > staged + tp.BACKWARD_SHARED_RESERVE:
                bad.append(name + " (shared memory)")
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
