"""What the benchmark runs: PERF.md's workloads (W1-W5), the public matrix, the CPU workloads.

A case is one call shape: layout, sizes, dtype, pairing style, positions and direction. Its
floor is the least time the bytes it must move can take (``bytes_moved``); which floor applies
depends on its size (``floor_kind``), and its targets (PERF.md) are stated against that floor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

TABLE_POSITIONS = 131072  # rows of the cos/sin table on a GPU (PERF.md)
CPU_TABLE_POSITIONS = 32768
DECODE_POSITIONS = 32768  # random decode positions lie in [0, DECODE_POSITIONS)

FEW_TOKENS = 8  # at most this many tokens: the floor is the dependent-load kernel
DECODE_TOKENS = 512  # at most this many tokens: the floor is a same-bytes copy kernel
LARGE_BYTES = 64_000_000  # at least this many bytes moved: PERF.md's copy-share targets apply


@dataclass(frozen=True)
class Target:
    """One PERF.md target for one provider: ``metric`` compared with ``value``."""

    provider: str  # "rope_ops:cuda", ...
    metric: str  # a key of the result row: pct_copy, x_floor, pct_floor, time_us, x_hf_eager, ...
    op: str  # ">=" or "<="
    value: float

    def text(self) -> str:
        unit = {"pct_copy": "% copy bw", "pct_floor": "% floor", "x_floor": "x floor",
                "time_us": " us", "x_hf_eager": "x hf-eager", "x_hf_compile": "x hf-compile",
                "pct_same_copy": "% copy"}[self.metric]
        return f"{self.op}{self.value:g}{unit}"

    def met(self, row: dict) -> bool | None:
        value = row.get(self.metric)
        if value is None:
            return None
        return value >= self.value if self.op == ">=" else value <= self.value


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    layout: str = "bshd"  # bshd, sbhd, bhsd or thd (tokens of all sequences packed)
    batch: int = 1  # sequences
    seq: int = 1  # tokens per sequence (thd with varlen positions: the mean length)
    q_heads: int = 32
    k_heads: int = 8
    head_dim: int = 128
    rotary_dim: int = 0  # 0: head_dim
    dtype: str = "bfloat16"
    style: str = "neox"
    base: float = 500000.0
    mode: str = "forward"  # forward, train (forward + backward through autograd), inplace
    positions: str = "arange"  # arange (per sequence), random, varlen (thd), offset (past the table)
    packed: bool = False  # q and k are views into one QKV tensor [..., Hq + 2 Hk, D]
    # Where the angles come from: "positions" (rope_ops' tables indexed by pos), "token" (the
    # per-token cos/sin a model computes, Hugging Face's [B, S, r] in the model's dtype, as the
    # peers get them) or "mrope" (text tokens' t, h, w positions, all equal, with mrope_section)
    angles: str = "positions"
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    mrope_interleaved: bool = False
    group: str = "matrix"  # W (PERF.md), matrix, cpu
    targets: tuple[Target, ...] = ()  # PERF.md targets beyond the general ones of its floor kind

    @property
    def rot(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def train(self) -> bool:
        return self.mode == "train"

    @property
    def inplace(self) -> bool:
        return self.mode == "inplace"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def bytes_moved(self) -> int:
        """q and k read once and written once (the rotary dims only in place), plus one cos/sin
        row (float32) and one int64 position per token; twice that for forward + backward."""
        size = torch.empty((), dtype=self.torch_dtype).element_size()
        touched = self.rot if self.inplace else self.head_dim
        data = 2 * self.tokens * (self.q_heads + self.k_heads) * touched * size
        if self.angles == "token":  # cos and sin rows [r] in the data's dtype, shared by a batch
            rows = self.seq if self.positions == "arange" and self.layout != "thd" else self.tokens
            tables = rows * 2 * self.rot * size
        else:
            tables = self.tokens * (self.rot * 4 + 8 * (3 if self.angles == "mrope" else 1))
        return (2 if self.train else 1) * (data + tables)

    def floor_kind(self) -> str:
        """copy (a same-bytes copy), copy-kernel (decode-sized: a copy kernel in a CUDA graph),
        dependent-load (a few tokens: position, then table row, then data), inplace (loads and
        stores of the rotary bytes at the same strides)."""
        if self.inplace:
            return "inplace"
        if self.tokens <= FEW_TOKENS:
            return "dependent-load"
        if self.tokens <= DECODE_TOKENS:
            return "copy-kernel"
        return "copy"

    def size_class(self) -> str:
        if self.inplace:
            return "inplace"
        if self.tokens <= FEW_TOKENS:
            return "few-token"
        if self.tokens <= DECODE_TOKENS:
            return "decode"
        return "large" if self.bytes_moved() >= LARGE_BYTES else "mid"

    def describe(self) -> str:
        rot = f" r{self.rot}" if self.rot != self.head_dim else ""
        heads = f"{self.q_heads}/{self.k_heads}"
        return (f"{self.layout}{' packed' if self.packed else ''} {self.batch}x{self.seq} "
                f"h{heads} d{self.head_dim}{rot} {self.style} {self.dtype} {self.mode} "
                f"{self.positions} pos" + ("" if self.angles == "positions" else f" {self.angles} angles"))

    def gpu_targets(self) -> list[Target]:
        """PERF.md "Beyond W1-W5" for this case's size class, then the case's own targets."""
        general = {
            "large": [Target("rope_ops:cuda", "pct_copy", ">=", 93), Target("rope_ops:triton", "pct_copy", ">=", 90)],
            "decode": [Target("rope_ops:cuda", "x_floor", "<=", 1.15)],
            "few-token": [Target("rope_ops:cuda", "x_floor", "<=", 1.1)],
            "inplace": [Target("rope_ops:cuda", "pct_floor", ">=", 95)],
            "mid": [],
        }[self.size_class()]
        own = {(t.provider, t.metric) for t in self.targets}
        return [t for t in general if (t.provider, t.metric) not in own] + list(self.targets)

    def cpu_targets(self) -> list[Target]:
        """PERF.md "CPU": the cpu backend against Hugging Face eager and compiled, and against a
        same-bytes copy on prefill and training; the torch backend against HF eager on bf16
        prefill."""
        targets = [Target("rope_ops:cpu", "x_hf_eager", ">=", 5), Target("rope_ops:cpu", "x_hf_compile", ">=", 2)]
        if self.mode == "train" or (self.mode == "forward" and self.seq > 1):
            targets.append(Target("rope_ops:cpu", "pct_same_copy", ">=", 80))
        if self.mode == "forward" and self.seq > 1 and self.dtype == "bfloat16":
            targets.append(Target("rope_ops:torch", "x_hf_eager", ">=", 1.5))
        return targets + list(self.targets)


def scaled(case: Case, scale: int) -> Case:
    """The case with its sequences 1/scale as long (CPU runs of GPU-sized cases)."""
    if scale <= 1 or case.seq <= 1:
        return case
    return dataclasses.replace(case, seq=max(1, case.seq // scale))


def with_dtype(case: Case, dtype: str | None) -> Case:
    return case if dtype is None else dataclasses.replace(case, dtype=dtype)


def _cuda(metric, op, value):
    return Target("rope_ops:cuda", metric, op, value)


def _triton(metric, op, value):
    return Target("rope_ops:triton", metric, op, value)


# PERF.md's workloads, as the earlier benches ran them: thd tensors, one position per token.
_W = dict(layout="thd", group="W")
WORKLOADS: dict[str, Case] = {c.name: c for c in [
    Case("W1", "prefill Llama-3-8B", batch=4, seq=4096, **_W,
         targets=(_cuda("pct_copy", ">=", 95), _triton("pct_copy", ">=", 92))),
    Case("W2", "decode, 256 tokens", batch=256, seq=1, positions="random", **_W,
         targets=(_cuda("time_us", "<=", 3.2), _triton("time_us", "<=", 4.0))),
    Case("W3", "GPT-J partial, out of place", batch=2, seq=4096, q_heads=16, k_heads=16, head_dim=256,
         rotary_dim=64, style="gptj", base=10000.0, **_W, targets=(_cuda("pct_copy", ">=", 93),)),
    Case("W3i", "GPT-J partial, in place", batch=2, seq=4096, q_heads=16, k_heads=16, head_dim=256,
         rotary_dim=64, style="gptj", base=10000.0, mode="inplace", **_W),
    Case("W4", "training fwd+bwd Llama-3-8B shapes", batch=2, seq=4096, k_heads=32, mode="train", **_W,
         targets=(_cuda("pct_copy", ">=", 95), _triton("pct_copy", ">=", 92))),
    Case("W5", "prefill 70B-like", batch=8, seq=4096, q_heads=64, **_W,
         targets=(_cuda("pct_copy", ">=", 97), _triton("pct_copy", ">=", 92))),
]}

# The public matrix: real models' shapes over every layout, dtype, style, head_dim, GQA ratio,
# token count, direction and kind of positions.
_QWEN = dict(base=1e6)
_OLD = dict(base=10000.0)
MATRIX: dict[str, Case] = {c.name: c for c in [
    # Llama-3-8B (32/8, d128) in every layout and way of calling
    Case("llama3-8b-bshd", "Llama-3-8B prefill 8k", batch=1, seq=8192),
    Case("llama3-8b-sbhd-fp16", "Llama-3-8B prefill, Megatron layout, fp16", layout="sbhd", batch=2, seq=4096,
         dtype="float16"),
    Case("llama3-8b-bhsd", "Llama-3-8B prefill, heads-major layout", layout="bhsd", batch=2, seq=4096),
    Case("llama3-8b-thd-varlen", "Llama-3-8B packed varlen prefill", layout="thd", batch=8, seq=2048,
         positions="varlen"),
    Case("llama3-8b-qkv-thd", "Llama-3-8B packed QKV views (vLLM)", layout="thd", batch=4, seq=2048,
         positions="varlen", packed=True),
    Case("llama3-8b-qkv-inplace", "Llama-3-8B packed QKV views, in place (vLLM)", layout="thd", batch=4,
         seq=2048, positions="varlen", packed=True, mode="inplace"),
    Case("llama3-8b-64k", "Llama-3-8B long prefill, 64k tokens", batch=1, seq=65536),
    Case("llama3-8b-random-pos", "Llama-3-8B prefill, random positions", batch=2, seq=4096, positions="random"),
    Case("llama3-8b-past-table", "Llama-3-8B prefill at positions past the table", batch=1, seq=4096,
         positions="offset"),
    Case("llama3-8b-short", "Llama-3-8B short prefill, 1k tokens", batch=1, seq=1024),
    Case("llama3-8b-train-sbhd", "Llama-3-8B training, Megatron layout", layout="sbhd", batch=1, seq=8192,
         mode="train"),
    Case("llama3-8b-train-qkv", "Llama-3-8B training on packed QKV views", batch=2, seq=4096, packed=True,
         mode="train"),
    Case("llama3-8b-train-fp32", "Llama-3-8B training, fp32", batch=1, seq=4096, dtype="float32",
         mode="train"),
    # decode: 1 / 8 / 64 / 256 tokens
    Case("llama3-8b-decode-1", "Llama-3-8B decode, 1 token", layout="thd", batch=1, positions="random"),
    Case("llama3-8b-decode-8", "Llama-3-8B decode, 8 tokens", layout="thd", batch=8, positions="random"),
    Case("llama3-8b-decode-64", "Llama-3-8B decode, 64 tokens", layout="thd", batch=64, positions="random"),
    Case("llama3-8b-decode-8-inplace", "Llama-3-8B decode in place on QKV views", layout="thd", batch=8,
         positions="random", packed=True, mode="inplace"),
    Case("llama3-70b-decode-256", "Llama-3-70B decode, 256 sequences (HF layout)", batch=256, seq=1,
         q_heads=64, positions="random"),
    Case("llama3-70b-train", "Llama-3-70B training", batch=1, seq=8192, q_heads=64, mode="train"),
    # Qwen, Mistral
    Case("qwen2-7b", "Qwen2-7B prefill (28/4)", batch=1, seq=8192, q_heads=28, k_heads=4, **_QWEN),
    Case("qwen3-8b-fp32", "Qwen3-8B prefill, fp32", batch=1, seq=4096, **_QWEN, dtype="float32"),
    Case("qwen2-0.5b-d64", "Qwen2-0.5B prefill (14/2, d64)", batch=4, seq=2048, q_heads=14, k_heads=2,
         head_dim=64, **_QWEN),
    Case("qwen3-8b-decode-64-fp16", "Qwen3-8B decode, 64 tokens, fp16", layout="thd", batch=64,
         positions="random", dtype="float16", **_QWEN),
    Case("mistral-7b-fp16", "Mistral-7B prefill, fp16", batch=2, seq=4096, dtype="float16", **_QWEN),
    # partial rotary: Phi-2 (d80 r32), Phi-3 (d96), GPT-NeoX-20B (d96 r24), Pythia (d128 r32)
    Case("phi2-d80-partial", "Phi-2 prefill (d80, rotary 32)", batch=2, seq=2048, q_heads=32, k_heads=32,
         head_dim=80, rotary_dim=32, dtype="float16", **_OLD),
    Case("phi2-decode-8", "Phi-2 decode, 8 tokens", layout="thd", batch=8, positions="random", q_heads=32,
         k_heads=32, head_dim=80, rotary_dim=32, dtype="float16", **_OLD),
    Case("phi3-mini-d96", "Phi-3-mini prefill (d96)", batch=2, seq=4096, q_heads=32, k_heads=32, head_dim=96,
         **_OLD),
    Case("phi3-mini-train", "Phi-3-mini training (d96)", batch=1, seq=4096, q_heads=32, k_heads=32,
         head_dim=96, mode="train", **_OLD),
    Case("gpt-neox-20b", "GPT-NeoX-20B prefill (d96, rotary 24)", batch=1, seq=4096, q_heads=64, k_heads=64,
         head_dim=96, rotary_dim=24, dtype="float16", **_OLD),
    Case("pythia-6.9b-train", "Pythia-6.9B training (rotary 32)", batch=2, seq=2048, q_heads=32, k_heads=32,
         rotary_dim=32, mode="train", **_OLD),
    # GPT-J style (interleaved pairs)
    Case("gptj-6b-bshd-fp16", "GPT-J-6B prefill (d256, rotary 64), fp16", batch=4, seq=2048, q_heads=16,
         k_heads=16, head_dim=256, rotary_dim=64, style="gptj", dtype="float16", **_OLD),
    Case("gptj-6b-decode-1", "GPT-J-6B decode, 1 token", layout="thd", batch=1, positions="random",
         q_heads=16, k_heads=16, head_dim=256, rotary_dim=64, style="gptj", **_OLD),
    Case("glm4-9b", "GLM-4-9B prefill (32/2, rotary 64, interleaved)", batch=1, seq=8192, k_heads=2,
         rotary_dim=64, style="gptj", **_OLD),
    Case("glm4-9b-inplace", "GLM-4-9B prefill in place", batch=1, seq=8192, k_heads=2, rotary_dim=64,
         style="gptj", mode="inplace", **_OLD),
    # angles given per token (Hugging Face's cos/sin, as a patched model passes them) and mRoPE
    Case("llama3-8b-hf-tables", "Llama-3-8B prefill, HF per-token cos/sin", batch=2, seq=4096,
         angles="token"),
    Case("llama3-8b-hf-tables-train", "Llama-3-8B training, HF per-token cos/sin", batch=2, seq=4096,
         mode="train", angles="token"),
    Case("llama3-8b-hf-tables-decode-64", "Llama-3-8B decode, 64 tokens, HF per-token cos/sin",
         layout="thd", batch=64, positions="random", angles="token"),
    Case("qwen2-vl-7b-mrope", "Qwen2-VL-7B prefill, mRoPE (28/4)", batch=2, seq=4096, q_heads=28,
         k_heads=4, angles="mrope", **_QWEN),
    Case("qwen2-vl-7b-mrope-train", "Qwen2-VL-7B training, mRoPE", batch=1, seq=8192, q_heads=28,
         k_heads=4, mode="train", angles="mrope", **_QWEN),
    Case("qwen2-vl-7b-mrope-thd", "Qwen2-VL-7B packed prefill, mRoPE", layout="thd", batch=4, seq=2048,
         q_heads=28, k_heads=4, positions="varlen", angles="mrope", **_QWEN),
    Case("qwen3-vl-8b-mrope", "Qwen3-VL-8B prefill, interleaved mRoPE", batch=2, seq=4096, angles="mrope",
         mrope_section=(24, 20, 20), mrope_interleaved=True, **_QWEN),
    Case("qwen3-vl-8b-mrope-thd", "Qwen3-VL-8B packed prefill, interleaved mRoPE", layout="thd", batch=4,
         seq=2048, positions="varlen", angles="mrope", mrope_section=(24, 20, 20), mrope_interleaved=True,
         **_QWEN),
    # head_dim 256, MQA
    Case("gemma-7b-d256", "Gemma-7B prefill (d256)", batch=2, seq=4096, q_heads=16, k_heads=16,
         head_dim=256, **_OLD),
    Case("gemma-2b-mqa-d256", "Gemma-2B prefill (8/1, d256)", batch=1, seq=8192, q_heads=8, k_heads=1,
         head_dim=256, **_OLD),
    Case("gemma-7b-decode-64", "Gemma-7B decode, 64 tokens (d256)", layout="thd", batch=64,
         positions="random", q_heads=16, k_heads=16, head_dim=256, **_OLD),
    Case("falcon-7b-mqa", "Falcon-7B-like prefill (71/1, d64)", batch=2, seq=2048, q_heads=71, k_heads=1,
         head_dim=64, **_OLD),
    Case("falcon-7b-decode-64", "Falcon-7B-like decode, 64 tokens (71/1)", layout="thd", batch=64,
         positions="random", q_heads=71, k_heads=1, head_dim=64, **_OLD),
]}

# PERF.md "CPU": 2048 tokens, 32 q / 8 kv heads, head_dim 128.
_C = dict(group="cpu", batch=1, seq=2048)
CPU_WORKLOADS: dict[str, Case] = {c.name: c for c in [
    Case("cpu-prefill-bf16", "prefill, bf16", **_C),
    Case("cpu-prefill-fp32", "prefill, fp32", dtype="float32", **_C),
    Case("cpu-decode", "decode, 1 token x 32 sequences, bf16", **{**_C, "batch": 32, "seq": 1},
         positions="random"),
    Case("cpu-train", "training forward + backward, fp32", dtype="float32", mode="train", **_C),
    Case("cpu-inplace", "prefill in place, bf16", mode="inplace", **_C),
]}

ALL_CASES: dict[str, Case] = {**WORKLOADS, **MATRIX, **CPU_WORKLOADS}
HOST_CASES = ("W2", "W4")  # host time per eager call: decode inference, training fwd+bwd
