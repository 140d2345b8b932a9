"""The benchmark's definitions, inputs, checks, providers, CPU path, report and kernel-candidate
study, on tiny shapes; the GPU path's floor kernels and bookkeeping through the Triton
interpreter (TRITON_INTERPRET=1, as tests/test_triton_backend.py)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import rope_ops
from rope_ops.bench import cases as cases_mod
from rope_ops.bench import providers as providers_mod
from rope_ops.bench import report, run as run_mod
from rope_ops.bench.cases import ALL_CASES, MATRIX, WORKLOADS, Case, Target
from rope_ops.bench.inputs import PAST_TABLE_OFFSET, check_outputs, make_inputs
from rope_ops import cli

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CPU = torch.device("cpu")


def tiny(case: Case, seq: int = 6, batch: int | None = None) -> Case:
    """The case shrunk to a few tokens (decode cases keep one token per sequence)."""
    return dataclasses.replace(case, seq=1 if case.seq == 1 else seq,
                               batch=min(case.batch, 3) if batch is None else batch)


def rope_for(case: Case, rows: int = 64):
    return rope_ops.RotaryEmbedding(case.head_dim, rotary_dim=case.rot, base=case.base, max_position=rows,
                                    style=case.style)


# ---------------------------------------------------------------------------------------------
# The cases


def test_matrix_covers_what_perf_md_asks():
    matrix = list(MATRIX.values())
    assert len(matrix) >= 30
    assert {c.layout for c in matrix} == {"bshd", "sbhd", "bhsd", "thd"}
    assert any(c.packed and c.layout == "thd" for c in matrix) and any(c.packed and c.layout == "bshd" for c in matrix)
    assert {c.dtype for c in matrix} == {"bfloat16", "float16", "float32"}
    assert {c.style for c in matrix} == {"neox", "gptj"}
    assert {c.head_dim for c in matrix} >= {64, 80, 96, 128, 256}
    assert any(c.rot < c.head_dim and c.style == "neox" for c in matrix)
    assert any(c.rot < c.head_dim and c.style == "gptj" for c in matrix)
    assert any(c.q_heads == c.k_heads for c in matrix)  # MHA
    assert any(1 < c.k_heads < c.q_heads for c in matrix)  # GQA
    assert any(c.k_heads == 1 for c in matrix)  # MQA
    assert {c.mode for c in matrix} == {"forward", "train", "inplace"}
    assert {c.positions for c in matrix} >= {"arange", "random", "varlen"}
    assert {c.angles for c in matrix} == {"positions", "token", "mrope"}
    assert any(c.angles == "mrope" and c.mrope_interleaved for c in matrix)
    tokens = {c.tokens for c in matrix} | {c.tokens for c in WORKLOADS.values()}
    assert {1, 8, 64, 256, 65536} <= tokens
    assert set(WORKLOADS) == {"W1", "W2", "W3", "W3i", "W4", "W5"}
    assert len(ALL_CASES) == len(WORKLOADS) + len(MATRIX) + len(cases_mod.CPU_WORKLOADS)  # unique names
    for case in ALL_CASES.values():  # every case is well formed
        assert case.rot % 2 == 0 and case.rot <= case.head_dim
        assert case.layout in ("bshd", "sbhd", "bhsd", "thd")
        assert case.positions != "varlen" or case.layout == "thd"
        assert not case.packed or case.layout in ("thd", "bshd")


def test_bytes_moved_and_floor_kinds():
    w1 = WORKLOADS["W1"]
    assert w1.bytes_moved() == 2 * 16384 * 40 * 128 * 2 + 16384 * (128 * 4 + 8)
    assert WORKLOADS["W4"].bytes_moved() == 2 * (2 * 8192 * 64 * 128 * 2 + 8192 * (128 * 4 + 8))
    w3i = WORKLOADS["W3i"]  # in place moves the rotary dims only
    assert w3i.bytes_moved() == 2 * 8192 * 32 * 64 * 2 + 8192 * (64 * 4 + 8)
    fp32 = dataclasses.replace(w1, dtype="float32")
    assert fp32.bytes_moved() - fp32.tokens * (128 * 4 + 8) == 2 * (w1.bytes_moved() - w1.tokens * (128 * 4 + 8))
    assert [WORKLOADS[w].floor_kind() for w in ("W1", "W2", "W3i", "W4")] == ["copy", "copy-kernel", "inplace", "copy"]
    assert MATRIX["llama3-8b-decode-1"].floor_kind() == "dependent-load"
    assert MATRIX["llama3-8b-decode-8"].size_class() == "few-token"
    assert MATRIX["llama3-8b-short"].size_class() == "mid"  # 21 MB: no copy-share target
    assert MATRIX["llama3-8b-short"].gpu_targets() == []


def test_targets_per_size_class_and_perf_md_overrides():
    by = lambda case: {(t.provider, t.metric): (t.op, t.value) for t in case.gpu_targets()}  # noqa: E731
    assert by(MATRIX["llama3-8b-bshd"]) == {("rope_ops:cuda", "pct_copy"): (">=", 93),
                                             ("rope_ops:triton", "pct_copy"): (">=", 90)}
    assert by(WORKLOADS["W5"])[("rope_ops:cuda", "pct_copy")] == (">=", 97)  # PERF.md's own, not 93
    assert by(WORKLOADS["W2"]) == {("rope_ops:cuda", "x_floor"): ("<=", 1.15), ("rope_ops:cuda", "time_us"): ("<=", 3.2),
                                   ("rope_ops:triton", "time_us"): ("<=", 4.0)}
    assert by(MATRIX["llama3-8b-decode-1"]) == {("rope_ops:cuda", "x_floor"): ("<=", 1.1)}
    assert by(WORKLOADS["W3i"]) == {("rope_ops:cuda", "pct_floor"): (">=", 95)}
    cpu = {(t.provider, t.metric) for t in cases_mod.CPU_WORKLOADS["cpu-prefill-bf16"].cpu_targets()}
    assert cpu == {("rope_ops:cpu", "x_hf_eager"), ("rope_ops:cpu", "x_hf_compile"), ("rope_ops:cpu", "pct_same_copy"),
                   ("rope_ops:torch", "x_hf_eager")}
    decode = {(t.provider, t.metric) for t in cases_mod.CPU_WORKLOADS["cpu-decode"].cpu_targets()}
    assert ("rope_ops:cpu", "pct_same_copy") not in decode  # % of copy: prefill and training only
    t = Target("rope_ops:cuda", "pct_copy", ">=", 93)
    assert t.met({"pct_copy": 93.0}) and not t.met({"pct_copy": 92.9}) and t.met({}) is None
    assert Target("rope_ops:cuda", "x_floor", "<=", 1.15).met({"x_floor": 1.2}) is False


# ---------------------------------------------------------------------------------------------
# Inputs and the reference check


@pytest.mark.parametrize("name", ["llama3-8b-sbhd-fp16", "llama3-8b-bhsd", "llama3-8b-qkv-thd", "llama3-8b-train-qkv",
                                  "W2", "llama3-8b-past-table", "llama3-70b-decode-256"])
def test_inputs_match_their_case(name):
    case = tiny(ALL_CASES[name])
    sets = make_inputs(case, CPU, 2)
    assert len(sets) == 2 and not torch.equal(sets[0].q, sets[1].q)
    s = sets[0]
    heads_axis = 1 if case.layout in ("bhsd", "thd") else 2
    assert s.q.shape[heads_axis] == case.q_heads and s.k.shape[heads_axis] == case.k_heads
    assert s.q.shape[-1] == case.head_dim and s.q.dtype == case.torch_dtype
    assert s.positions.numel() == case.tokens
    if case.packed:  # views into one QKV tensor: no copies, the QKV row stride
        assert s.q.data_ptr() == s.qkv.data_ptr() and s.k.untyped_storage().data_ptr() == s.qkv.data_ptr()
        assert s.q.stride(heads_axis - 1) == (case.q_heads + 2 * case.k_heads) * case.head_dim
    if case.positions == "offset":
        assert int(s.positions.min()) == PAST_TABLE_OFFSET
    if case.train:
        assert s.grad_q.shape == s.q.shape
    fresh = s.fresh()
    assert fresh.q.stride() == s.q.stride() and torch.equal(fresh.q, s.q)
    assert fresh.q.untyped_storage().data_ptr() != s.q.untyped_storage().data_ptr()


def test_varlen_positions_restart_per_sequence():
    case = dataclasses.replace(MATRIX["llama3-8b-thd-varlen"], batch=5, seq=40)
    pos = make_inputs(case, CPU, 1)[0].pos
    starts = (pos == 0).nonzero().flatten().tolist()
    assert len(starts) == 5 and starts[0] == 0 and pos.numel() == 200
    lengths = [b - a for a, b in zip(starts, starts[1:] + [200])]
    assert len(set(lengths)) > 1  # lengths vary
    for start, length in zip(starts, lengths):
        assert torch.equal(pos[start:start + length], torch.arange(length))


@pytest.mark.parametrize("name", ["llama3-8b-sbhd-fp16", "llama3-8b-bhsd", "llama3-8b-qkv-thd", "gptj-6b-bshd-fp16",
                                  "phi2-d80-partial", "llama3-8b-random-pos"])
def test_check_accepts_the_reference_and_catches_errors(name):
    case = tiny(ALL_CASES[name])
    rope = rope_for(case)
    s = make_inputs(case, CPU, 1)[0]
    good = rope_ops.apply(s.q, s.k, s.pos, rope=rope, layout=case.layout, backend="torch")
    assert check_outputs(case, s, good, rope.inv_freq, rope.attention_factor) == "ok"
    bad_q = good[0].clone()
    bad_q[..., 0] += 0.25  # index 0 is in the first tokens' rows of every layout
    assert check_outputs(case, s, (bad_q, good[1]), rope.inv_freq, rope.attention_factor).startswith("MISMATCH")
    tail = good[1].clone()
    tail[..., -1] += 1  # a pass-through dim (or the last rotary dim) changed
    assert check_outputs(case, s, (good[0], tail), rope.inv_freq, rope.attention_factor).startswith("MISMATCH")
    unrotated = (s.q.clone(), s.k.clone())
    assert check_outputs(case, s, unrotated, rope.inv_freq, rope.attention_factor).startswith("MISMATCH")


# ---------------------------------------------------------------------------------------------
# Providers


def _run_provider(name: str, case: Case, rope):
    provider = providers_mod.make(name)
    sets = make_inputs(case, CPU, 2)
    fresh = sets[0].fresh()
    before = fresh.fresh()
    out = provider.build(case, [fresh], rope)[0]()
    return check_outputs(case, before, provider.layout_outputs(case, out), rope.inv_freq, rope.attention_factor)


@pytest.mark.parametrize("name", ["llama3-8b-sbhd-fp16", "llama3-8b-bhsd", "llama3-8b-qkv-thd", "gptj-6b-bshd-fp16",
                                  "phi2-d80-partial", "llama3-8b-train-qkv", "glm4-9b-inplace", "llama3-8b-qkv-inplace",
                                  "llama3-70b-decode-256", "W3"])
def test_providers_compute_the_case(name):
    """rope_ops passes the check; the Hugging Face form, in float32 at small positions (where its
    float32 angles are exact enough), passes it too: its layouts, pairings, partial rotary, in
    place and gradients are the case's."""
    case = tiny(ALL_CASES[name])
    rope = rope_for(case)
    assert _run_provider("torch", case, rope) == "ok"
    fp32 = dataclasses.replace(case, dtype="float32", positions="arange" if case.positions == "random" else case.positions)
    assert _run_provider("hf-eager", fp32, rope) == "ok"


def _provider_check(name: str, case: Case, rope, tamper=None):
    """_run_provider with the token cases' tables passed to the check (``tamper`` changes them
    first: the check must then fail)."""
    provider = providers_mod.make(name)
    fresh = make_inputs(case, CPU, 1)[0]
    before = fresh.fresh()
    out = provider.build(case, [fresh], rope)[0]()
    tables = providers_mod.peer_tables(case, before, rope) if case.angles == "token" else None
    if tamper is not None:
        tables = tamper(tables)
    return check_outputs(case, before, provider.layout_outputs(case, out), rope.inv_freq,
                         rope.attention_factor, tables)


@pytest.mark.parametrize("name", [n for n, c in MATRIX.items() if c.angles != "positions"])
def test_angle_cases_call_and_check_what_they_say(name, monkeypatch):
    """Per-token cases hand rope_ops the peers' tables (pos None) and are checked against those
    tables as rounded; mRoPE cases pass [3, ...] positions with the case's section."""
    case = tiny(ALL_CASES[name])
    rope = rope_for(case, rows=4096)
    calls = []
    original = rope_ops.apply

    def recording(q, k, pos, **kwargs):
        calls.append((pos, kwargs))
        return original(q, k, pos, **kwargs)

    monkeypatch.setattr(rope_ops, "apply", recording)
    assert _provider_check("torch", case, rope) == "ok"
    pos, kwargs = calls[0]
    if case.angles == "token":
        assert pos is None and kwargs["cos_sin"][0].dtype == case.torch_dtype
        shifted = lambda tables: tuple(torch.roll(t, 1, dims=-2) for t in tables)  # noqa: E731
        assert _provider_check("torch", case, rope, shifted).startswith("MISMATCH")
    else:
        assert pos.shape[0] == 3 and torch.equal(pos[0], pos[1]) and torch.equal(pos[1], pos[2])
        assert kwargs["mrope_section"] == case.mrope_section
        assert kwargs["mrope_interleaved"] == case.mrope_interleaved


def test_peers_skip_with_reasons_on_cpu():
    case = tiny(MATRIX["llama3-8b-bshd"])
    sets = make_inputs(case, CPU, 1)
    with pytest.raises(providers_mod.Skip, match="Liger|liger"):
        providers_mod.make("liger").build(case, sets, rope_for(case))
    with pytest.raises(providers_mod.Skip, match="unknown backend"):
        providers_mod.RopeOps("no-such-backend").build(case, sets, rope_for(case))


def test_provider_names():
    valid = providers_mod.valid_names()
    assert {"torch", "cuda", "triton", "cpu", "liger", "hf-eager", "hf-compile"} <= set(valid)
    assert providers_mod.canonical("rope_ops:cuda") == "cuda" and providers_mod.display_name("cuda") == "rope_ops:cuda"


# ---------------------------------------------------------------------------------------------
# The CPU path, end to end through the command line


def test_cpu_bench_end_to_end(tmp_path, capsys):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    code = cli.main(["bench", "--workloads", "cpu-decode,cpu-train,cpu-inplace", "--scale", "256",
                     "--providers", "torch,hf-eager",
                     "--repeats", "3", "--time-ms", "2", "--threads", "1", "--json", str(out_json),
                     "--markdown", str(out_md)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads(out_json.read_text())
    assert results["environment"]["threads"] == 1 and "allocator" in results["environment"]
    rows = {(r["case"], r["provider"]): r for r in results["rows"]}
    assert set(rows) == {(c, p) for c in ("cpu-decode", "cpu-train", "cpu-inplace")
                         for p in ("same-bytes copy", "rope_ops:torch", "hf-eager")}
    for (case, provider), row in rows.items():
        assert row["min_us"] <= row["time_us"] <= row["max_us"] and row["spread_pct"] >= 0
        if provider == "same-bytes copy":
            assert "pct_same_copy" not in row  # no "% copy" of the copy itself
        else:
            assert row["pct_same_copy"] == pytest.approx(100 * rows[(case, "same-bytes copy")]["time_us"] / row["time_us"])
        if provider == "hf-eager":
            assert "x_hf_eager" not in row
        else:
            assert row["x_hf_eager"] == pytest.approx(rows[(case, "hf-eager")]["time_us"] / row["time_us"])
    assert rows[("cpu-train", "rope_ops:torch")]["check"] == "ok"
    assert rows[("cpu-inplace", "rope_ops:torch")]["check"] == "ok"
    assert rows[("cpu-decode", "rope_ops:torch")]["check"] == "ok"
    # the targets of the cpu backend are not evaluated for rows of other providers
    assert "targets" not in rows[("cpu-decode", "hf-eager")]
    assert "median us" in captured.out and "spread" in captured.out and "1 threads" in captured.out
    assert "[3/3] cpu-inplace" in captured.err and "ETA" in captured.err  # progress per case
    md = out_md.read_text()
    assert "| cpu-train | rope_ops:torch |" in md and "Allocator:" in md and "commit" in md


def test_cpu_bench_fails_when_a_rope_ops_backend_is_wrong(monkeypatch, capsys):
    from rope_ops_backends.torch_backend import TorchBackend

    real_run = TorchBackend.run

    def off_by_a_bit(self, args):
        made = real_run(self, args)
        args.q_out[..., :1].add_(0.5)
        return made

    monkeypatch.setattr(TorchBackend, "run", off_by_a_bit)
    rope_ops._select.clear_cache()
    try:
        code = cli.main(["bench", "--workloads", "cpu-decode", "--providers", "torch", "--repeats", "1",
                         "--time-ms", "1", "--threads", "1"])
    finally:
        rope_ops._select.clear_cache()
    captured = capsys.readouterr()
    assert code == 1 and "FAILED: cpu-decode rope_ops:torch: MISMATCH" in captured.err


# ---------------------------------------------------------------------------------------------
# Report: GPU rows, host time, candidates, merging and re-rendering


def _gpu_results() -> dict:
    env = {"date": "2026-12-02 10:00:00", "commit": "abc1234", "rope_ops": "0.1.0", "python": "3.12",
           "torch": "2.11", "triton": "3.6", "transformers": "5.17", "liger_kernel": None, "machine": "x86_64",
           "cpu": "cpu", "cpu_count": 16, "threads": 16, "device": "cuda", "gpu": "NVIDIA H200", "cuda": "13.0",
           "driver": "580", "sms": 132, "l2_mb": 60.0}
    row = {"case": "W1", "provider": "rope_ops:cuda", "time_us": 85.0, "GBps": 4000.0, "pct_copy": 95.5,
           "x_floor": 1.06, "pct_floor": 94.3, "check": "ok"}
    run_mod._apply_targets(row, WORKLOADS["W1"].gpu_targets())
    floor = {"case": "W1", "provider": "floor (copy)", "time_us": 80.3, "GBps": 4200.0, "pct_copy": 98.3,
             "floor": True, "floor_config": "torch copy_"}
    skipped = {"case": "W1", "provider": "liger", "skipped": "liger_kernel not importable"}
    return {"environment": env, "providers": ["rope_ops:cuda", "liger"], "copy_bandwidth_GBps": 4230.0,
            "cases": {"W1": {"title": "prefill", "describe": WORKLOADS["W1"].describe()}},
            "rows": [floor, row, skipped],
            "host": [{"case": "W2", "provider": "rope_ops:cuda", "host_us": 7.5, "wall_us": 7.9}]}


def test_gpu_report_rows_targets_and_render(tmp_path):
    results = _gpu_results()
    row = results["rows"][1]
    assert row["targets"] == [{"target": ">=95% copy bw", "met": True}] and row["met"] is True
    text = report.render(results)
    assert "NVIDIA H200" in text and "4230 GB/s" in text and "met" in text and "skipped: liger_kernel" in text
    assert "Host time per eager call" in text
    md = report.markdown(results)
    assert "| W1 | rope_ops:cuda | 85.00 |" in md and "driver 580" in md and "## Host time" in md
    missed = dict(row, pct_copy=94.0)
    run_mod._apply_targets(missed, WORKLOADS["W1"].gpu_targets())
    assert missed["met"] is False and "NOT MET: >=95% copy bw" in report.render({**results, "rows": [missed]})
    pytest.importorskip("matplotlib")
    report.plot(results, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").stat().st_size > 1000


def test_render_merges_saved_results(tmp_path, capsys):
    a, b = _gpu_results(), _gpu_results()
    b["rows"] = [dict(r, case="W5") for r in b["rows"]]
    b["copy_bandwidth_GBps"] = 4180.0
    del b["host"]
    for name, part in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(part))
    out = tmp_path / "merged.md"
    code = cli.main(["bench", "--render", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}", "--markdown", str(out)])
    assert code == 0
    md = out.read_text()
    assert "| W1 | rope_ops:cuda |" in md and "| W5 | rope_ops:cuda |" in md and "copy bandwidths [4180, 4230]" in md
    assert cli.main(["bench", "--render", str(tmp_path / "missing.json")]) == 2
    assert "cannot read results" in capsys.readouterr().err


class FakeCandidates:
    """A backend module exposing kernel candidates: 'policy' and 'fast' are right, 'broken' is not."""

    def __init__(self, run):
        self.run = run
        self.ran = []

    def kernel_candidates(self, args):
        return ["policy", "fast", "broken"]

    def run_with(self, args, label):
        self.ran.append(label)
        self.run(args)
        if label == "broken":
            args.q_out[..., :1].add_(1.0)


def test_candidates_report_policy_against_best(monkeypatch):
    from rope_ops.bench import candidates
    from rope_ops_backends.torch_backend import TorchBackend

    times = {"policy": 2e-6, "fast": 1e-6, "broken": 0.5e-6}
    fake = FakeCandidates(TorchBackend().run)

    def fake_timer(closures, **kw):
        for fn in closures:
            fn()
        return times[fake.ran[-1]]

    monkeypatch.setattr(candidates, "gpu_time_per_call", fake_timer)
    case = tiny(MATRIX["llama3-8b-train-qkv"])
    entries = candidates.time_candidates(case, make_inputs(case, CPU, 2), rope_for(case), fake, graph_seconds=1e-3)
    assert [e["direction"] for e in entries] == ["forward", "backward"]
    for entry in entries:
        assert entry["policy"] == "policy" and entry["best"] == "fast"  # "broken" is faster but wrong
        assert entry["gap_pct"] == pytest.approx(100.0)
        assert {c["label"]: c["check"].split(":")[0] for c in entry["candidates"]} == {
            "policy": "ok", "fast": "ok", "broken": "MISMATCH"}
    results = {"candidates": [{"backend": "cuda", **e} for e in entries], "rows": []}
    assert run_mod.failures(results) == []  # a wrong non-policy candidate is reported, not failed
    text = report.text_table(report.CANDIDATE_COLUMNS, results["candidates"])
    assert "broken (MISMATCH" in text and "100.0" in text
    # a candidates-only GPU run measures no copy bandwidth: it renders all the same
    gpu_run = {**_gpu_results(), "candidates": results["candidates"], "rows": []}
    del gpu_run["copy_bandwidth_GBps"], gpu_run["host"]
    assert "Same-run copy" not in report.render(gpu_run) and "broken (MISMATCH" in report.markdown(gpu_run)
    module, why = candidates.backend_module("torch")
    assert module is None and "kernel_candidates" in why


# ---------------------------------------------------------------------------------------------
# GPU path through the Triton interpreter: floor kernels, and one case's bookkeeping


needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (Triton interpreter on the CPU)")


@needs_interpreter
def test_floor_kernels_move_exactly_the_data():
    from rope_ops.bench import floors

    src = torch.randint(-1000, 1000, (3000,), dtype=torch.int32)
    dst = torch.zeros_like(src)
    floors.launch_copy(src, dst, 512)
    assert torch.equal(src, dst)
    case = tiny(MATRIX["phi2-decode-8"])
    rope = rope_for(case, rows=16)
    tables = rope.tables(CPU)
    x = torch.randn(case.tokens, case.q_heads + case.k_heads, case.head_dim).half()
    y = torch.zeros_like(x)
    pos = torch.tensor([3, 40, -5, 15, 0, 1, 2, 9][:case.tokens])  # outside the table too
    floors.launch_dependent_load(pos, tables.cos, tables.sin, x, y, case.rot, (4, 2))
    assert torch.equal(x, y)
    for name in ("llama3-8b-qkv-inplace", "glm4-9b-inplace", "W3i"):
        case = tiny(ALL_CASES[name])
        s = make_inputs(case, CPU, 1)[0]
        before = (s.qkv if s.qkv is not None else s.q).clone(), s.k.clone()
        floors.launch_inplace(s.q, s.k, case.layout, case.rot, (2, 1))
        assert torch.equal(before[0], s.qkv if s.qkv is not None else s.q) and torch.equal(before[1], s.k)


@needs_interpreter
@pytest.mark.parametrize("name", ["llama3-8b-decode-1", "llama3-8b-decode-64", "glm4-9b-inplace", "llama3-8b-bhsd"])
def test_gpu_case_bookkeeping(monkeypatch, name):
    """gpu_case on the CPU with a stand-in timer: the floor of the case's kind, every provider's
    row, ratios to the floor and the copy, and the targets."""
    from rope_ops.bench import floors

    def fake_timer(closures, **kw):
        for fn in closures:
            fn()
        return 2e-6

    monkeypatch.setattr(floors, "gpu_time_per_call", lambda closures, **kw: (fake_timer(closures), 1e-6)[1])
    monkeypatch.setattr(run_mod, "gpu_time_per_call", fake_timer)
    monkeypatch.setattr(run_mod, "copy_time", lambda n, device, sets: 1.5e-6)
    case = tiny(ALL_CASES[name])
    opts = run_mod.Options(cases=[case], providers=["torch", "hf-eager", "liger"], device=CPU, sets=2)
    rows = run_mod.gpu_case(case, opts, bandwidth=1e12)
    floor, ours, hf, liger = rows
    assert floor["provider"] == f"floor ({case.floor_kind()})"
    expected_floor = 1.5 if case.floor_kind() == "copy" else 1.0
    assert floor["time_us"] == pytest.approx(expected_floor)
    assert ours["check"] == "ok" and ours["x_floor"] == pytest.approx(2 / expected_floor)
    assert ours["pct_floor"] == pytest.approx(100 * expected_floor / 2)
    assert ours["pct_copy"] == pytest.approx(100 * case.bytes_moved() / 2e-6 / 1e12)
    assert "time_us" in hf and "skipped" in liger


def test_a_case_or_floor_that_cannot_run_is_recorded_and_fails_the_run(monkeypatch, capsys):
    def no_inputs(case, device, n_sets, seed=0):
        raise MemoryError("no room for the inputs")

    monkeypatch.setattr(run_mod, "make_inputs", no_inputs)
    code = cli.main(["bench", "--workloads", "cpu-decode", "--providers", "torch", "--repeats", "1",
                     "--time-ms", "1", "--threads", "1"])
    captured = capsys.readouterr()
    assert code == 1 and "FAILED: cpu-decode (whole case): MemoryError: no room for the inputs" in captured.err
    assert "[1/1] cpu-decode" in captured.err


@needs_interpreter
def test_gpu_case_without_its_floor(monkeypatch):
    from rope_ops.bench import floors

    def broken(*args, **kw):
        raise RuntimeError("floor kernel failed to compile")

    monkeypatch.setattr(floors, "inplace_floor_time", broken)
    monkeypatch.setattr(run_mod, "gpu_time_per_call", lambda closures, **kw: ([fn() for fn in closures], 2e-6)[1])
    monkeypatch.setattr(run_mod, "copy_time", lambda n, device, sets: 1.5e-6)
    case = tiny(MATRIX["glm4-9b-inplace"])
    rows = run_mod.gpu_case(case, run_mod.Options(cases=[case], providers=["torch"], device=CPU, sets=2), 1e12)
    assert "floor kernel failed" in rows[0]["error"] and rows[1]["check"] == "ok"
    assert "x_floor" not in rows[1] and rows[1]["time_us"] == pytest.approx(2)
    assert run_mod.failures({"rows": rows}) == [f"{case.name} floor (inplace): RuntimeError: floor kernel failed to compile"]


def test_host_rows_time_each_provider(monkeypatch):
    small = {key: tiny(WORKLOADS[key], seq=4, batch=2) for key in ("W2", "W4")}
    monkeypatch.setattr(run_mod, "WORKLOADS", small)
    opts = run_mod.Options(cases=[], providers=["torch", "hf-eager", "liger"], device=CPU)
    rows = {(r["case"], r["provider"]): r for r in run_mod.host_rows(opts)}
    assert set(rows) == {(w, p) for w in ("W2", "W4") for p in ("rope_ops:torch", "hf-eager", "liger")}
    for (case, provider), row in rows.items():
        if provider == "liger":
            assert "skipped" in row
        else:
            assert 0 < row["host_us"] <= row["wall_us"]


def test_cpu_report_warns_when_other_processes_loaded_the_machine():
    env = {"device": "cpu", "cpu": "x86", "threads": 1, "cpu_count": 2, "python": "3", "torch": "2", "rope_ops": "0",
           "commit": "c", "date": "d", "load_average": 5.8, "load_average_end": 5.9}
    busy = {"environment": env, "providers": [], "rows": []}
    assert "WARNING: the load average was 5.8 on 2 CPUs" in report.render(busy)
    assert "**WARNING" in report.markdown(busy)
    quiet = {**busy, "environment": {**env, "load_average": 0.1}}
    assert "WARNING" not in report.render(quiet) and "load average 0.1 -> 5.9" in report.render(quiet)
