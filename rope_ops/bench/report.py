"""The results as a table on stdout, a Markdown results file, and a chart."""

from __future__ import annotations

import textwrap

from .cases import DECODE_TOKENS, FEW_TOKENS, LARGE_BYTES


def _f(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _status(row: dict) -> str:
    if "skipped" in row:
        return "skipped: " + row["skipped"]
    if "error" in row:
        return "ERROR: " + row["error"]
    return str(row.get("check", ""))


def _met(row: dict) -> str:
    if "met" not in row:
        return ""
    if row["met"] is None:
        return "?"
    if row["met"]:
        return "met"
    return "NOT MET: " + ", ".join(t["target"] for t in row["targets"] if t["met"] is False)


def _targets(row: dict) -> str:
    return "; ".join(t["target"] for t in row.get("targets", []))


GPU_COLUMNS = [
    ("case", lambda r: r["case"]),
    ("provider", lambda r: r["provider"]),
    ("time us", lambda r: _f(r.get("time_us"), ".2f", "")),
    ("GB/s", lambda r: _f(r.get("GBps"), ".0f", "")),
    ("% copy bw", lambda r: _f(r.get("pct_copy"), ".1f", "")),
    ("x floor", lambda r: _f(r.get("x_floor"), ".3f", "")),
    ("% floor", lambda r: _f(r.get("pct_floor"), ".1f", "")),
    ("targets", _targets),
    ("met", _met),
    ("check", lambda r: r.get("floor_config", "") if r.get("floor") and "error" not in r else _status(r)),
]

CPU_COLUMNS = [
    ("case", lambda r: r["case"]),
    ("provider", lambda r: r["provider"]),
    ("median us", lambda r: _f(r.get("time_us"), ".1f", "")),
    ("spread", lambda r: "" if "spread_pct" not in r else f"±{r['spread_pct']:.1f}%"),
    ("GB/s", lambda r: _f(r.get("GBps"), ".1f", "")),
    ("% copy", lambda r: _f(r.get("pct_same_copy"), ".1f", "" if r.get("floor") or "time_us" not in r else "-")),
    ("x hf-eager", lambda r: _f(r.get("x_hf_eager"), ".2f", "" if "time_us" not in r else "-")),
    ("x hf-compile", lambda r: _f(r.get("x_hf_compile"), ".2f", "" if "time_us" not in r else "-")),
    ("targets", _targets),
    ("met", _met),
    ("check", lambda r: "" if r.get("floor") else _status(r)),
]

HOST_COLUMNS = [
    ("case", lambda r: r["case"]),
    ("provider", lambda r: r["provider"]),
    ("host us/call", lambda r: _f(r.get("host_us"), ".1f", "")),
    ("wall us/call", lambda r: _f(r.get("wall_us"), ".1f", "")),
    ("note", lambda r: _status(r) if ("skipped" in r or "error" in r) else ""),
]

CANDIDATE_COLUMNS = [
    ("case", lambda e: e["case"]),
    ("backend", lambda e: e["backend"]),
    ("direction", lambda e: e["direction"]),
    ("policy", lambda e: str(e.get("policy", ""))),
    ("policy us", lambda e: _f(e.get("policy_us"), ".2f", "")),
    ("best", lambda e: str(e.get("best", ""))),
    ("best us", lambda e: _f(e.get("best_us"), ".2f", "")),
    ("gap %", lambda e: _f(e.get("gap_pct"), ".1f", "")),
    ("candidates", lambda e: str(len(e.get("candidates", [])))),
    ("failed", lambda e: e.get("error") or ", ".join(
        f"{c['label']} ({c.get('error') or c.get('check')})" for c in e.get("candidates", [])
        if c.get("error") or str(c.get("check", "")).startswith("MISMATCH"))),
]


def _cells(columns, rows, width_limit: int | None) -> list[list[str]]:
    out = []
    for row in rows:
        cells = [fn(row) for _, fn in columns]
        if width_limit:
            cells = [c if len(c) <= width_limit else c[:width_limit - 3] + "..." for c in cells]
        out.append(cells)
    return out


def text_table(columns, rows, width_limit: int = 70) -> str:
    header = [name for name, _ in columns]
    body = _cells(columns, rows, width_limit)
    widths = [max([len(header[i])] + [len(r[i]) for r in body]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    return "\n".join(lines)


def markdown_table(columns, rows) -> str:
    header = [name for name, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cells in _cells(columns, rows, None):
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def platform_line(results: dict) -> str:
    env = results["environment"]
    versions = ", ".join(f"{name} {env[key]}" for name, key in (("torch", "torch"), ("triton", "triton"),
                         ("transformers", "transformers"), ("liger-kernel", "liger_kernel")) if env.get(key))
    if env["device"] == "cuda":
        where = (f"{env['gpu']} ({env['sms']} SMs, L2 {env['l2_mb']:.0f} MB), driver {env.get('driver') or '?'}, "
                 f"CUDA {env['cuda']}, host {env['cpu']} ({env['cpu_count']} CPUs)")
    else:
        where = f"{env['cpu']}, {env['threads']} threads (torch.get_num_threads) of {env['cpu_count']} CPUs"
        loads = [x for x in (env.get("load_average"), env.get("load_average_end")) if x is not None]
        if loads:
            where += f", load average {' -> '.join(f'{x:g}' for x in loads)} (start -> end of the run)"
    note = f" ({env['note']})" if env.get("note") else ""
    return (f"{where}; {versions}; python {env['python']}; rope_ops {env['rope_ops']} commit {env['commit']}; "
            f"{env['date']}{note}")


def copy_lines(results: dict) -> list[str]:
    """The same-run copy bandwidth, where the run measured one (a candidates-only run does not)."""
    if "copy_bandwidth_GBps" not in results:
        return []
    return [f"Same-run copy bandwidth: {results['copy_bandwidth_GBps']:.0f} GB/s (2 GiB device-to-device "
            "copy, bytes read + written)."]


def method_lines(results: dict) -> list[str]:
    env = results["environment"]
    if env["device"] == "cuda":
        return copy_lines(results) + [
            "GPU time: calls captured in one CUDA graph (~20 ms of work), replay time / calls, median of the "
            "replays, after warm-up, rotating input sets that together exceed 3x the L2.",
            "Bytes: q and k read and written once (rotary dims only in place), one float32 cos/sin row and one "
            "int64 position per token; twice for forward + backward. `% copy bw` = bytes / time / copy bandwidth.",
            f"Floor per case, same run: `copy` (torch same-bytes copy; cases over {DECODE_TOKENS} tokens), "
            f"`copy-kernel` (a Triton same-bytes copy kernel in a CUDA graph; {FEW_TOKENS + 1}-{DECODE_TOKENS} "
            f"tokens), `dependent-load` (a Triton kernel loading the position, then the table row, then storing "
            f"the data; up to {FEW_TOKENS} tokens), `inplace` (a Triton kernel loading and storing back the "
            "rotary bytes at the same strides). `x floor` = time / floor, `% floor` = floor / time.",
            f"Targets (PERF.md): CUDA >= 93 % copy bw on cases moving >= {LARGE_BYTES / 1e6:.0f} MB (Triton "
            ">= 90 %), decode-sized <= 1.15x floor, few-token <= 1.1x floor, in place >= 95 % of floor; W1-W5 "
            "their own.",
            "Check: outputs of the first and last tokens against the float64 reference within SPEC's bounds "
            "(peers compute in the input dtype and are expected to miss the bf16/fp16 bound).",
        ]
    return [
        f"Allocator: {env.get('allocator', 'not warmed')}.",
        "CPU time: per case and provider, timed loops of ~50 ms each (calls rotating over the input sets); "
        "median and spread (half the min-max range, in % of the median) of the loops, after two warm-up rounds.",
        "`% copy` = a same-bytes copy's median time (into preallocated memory, same run) / the row's; "
        "`x hf-eager` / `x hf-compile` = that provider's time / the row's. Hugging Face's cos/sin come from "
        "its rotary module, computed once per input set outside the timed call (as models share them "
        "between layers); hf-compile is torch.compile(fullgraph) of the same function.",
        "Targets (PERF.md): cpu backend >= 5x hf-eager and >= 2x hf-compile, >= 80 % copy on prefill and "
        "training; torch backend >= 1.5x hf-eager on bf16 prefill.",
    ]


def load_warning(results: dict) -> str | None:
    """A warning when other processes kept the CPUs busy during a CPU run."""
    env = results["environment"]
    load = env.get("load_average")
    if env["device"] == "cuda" or load is None or load <= 0.5:
        return None
    return (f"WARNING: the load average was {load:g} on {env['cpu_count']} CPUs before the run started: other "
            "processes competed for the CPUs, so these times are not the code's alone (compare rows within the "
            "run, watch the spread; --threads 1 suffers least)")


def render(results: dict) -> str:
    parts = [f"rope_ops bench: {platform_line(results)}"]
    # the method's lead line: the copy bandwidth on a GPU (none in a candidates-only run), the
    # allocator on a CPU
    parts += copy_lines(results) if results["environment"]["device"] == "cuda" else method_lines(results)[:1]
    warning = load_warning(results)
    if warning:
        parts.append(warning)
    if results.get("rows"):
        columns = GPU_COLUMNS if results["environment"]["device"] == "cuda" else CPU_COLUMNS
        parts += ["", text_table(columns, results["rows"])]
    if results.get("host"):
        parts += ["", "Host time per eager call (W2 decode inference, W4 training forward + backward):",
                  text_table(HOST_COLUMNS, results["host"])]
    if "candidates" in results:
        parts += ["", "Kernel candidates (policy's choice against the best candidate whose outputs pass the check):"]
        for name, why in results.get("candidates_missing", {}).items():
            parts.append(f"  {name}: {why}")
        if results["candidates"]:
            parts.append(text_table(CANDIDATE_COLUMNS, results["candidates"], width_limit=90))
    return "\n".join(parts)


def markdown(results: dict) -> str:
    env = results["environment"]
    title = env.get("gpu") or f"CPU ({env['cpu']})"
    lines = [f"# rope_ops benchmark: {title}", "",
             f"Written by `python -m rope_ops bench` ({'--candidates' if 'candidates' in results else 'providers: ' + ', '.join(results['providers'])}).",
             "", f"Platform: {platform_line(results)}.", ""]
    lines += [f"- {line}" for line in method_lines(results)]
    warning = load_warning(results)
    if warning:
        lines += ["", f"**{warning}**"]
    if results.get("rows"):
        columns = GPU_COLUMNS if env["device"] == "cuda" else CPU_COLUMNS
        lines += ["", "## Results", "", markdown_table(columns, results["rows"])]
    if results.get("host"):
        lines += ["", "## Host time per eager call", "",
                  "`host` = the host's time to make the call (loop before the final synchronisation), `wall` = "
                  "with waiting for the GPU (best of three loops).", "", markdown_table(HOST_COLUMNS, results["host"])]
    if "candidates" in results:
        lines += ["", "## Kernel candidates", ""]
        lines += [f"- {name}: {why}" for name, why in results.get("candidates_missing", {}).items()]
        if results["candidates"]:
            lines += ["", markdown_table(CANDIDATE_COLUMNS, results["candidates"])]
    cases = results.get("cases", {})
    if cases:
        lines += ["", "## Cases", "", "| case | what | shape |", "|---|---|---|"]
        lines += [f"| {name} | {c['title']} | {c['describe']} |" for name, c in cases.items()]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    """One panel per rope_ops backend: % of the floor per case (GPU; % of a same-bytes copy on a
    CPU), the peers' bars beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = results["environment"]["device"] == "cuda"
    metric = "pct_floor" if gpu else "pct_same_copy"
    rows = [r for r in results["rows"] if metric in r]
    cases = list(dict.fromkeys(r["case"] for r in results["rows"]))
    ours = [p for p in dict.fromkeys(r["provider"] for r in rows) if p.startswith("rope_ops:")]
    peers = [p for p in dict.fromkeys(r["provider"] for r in rows) if not p.startswith("rope_ops:")]
    if not ours:
        ours = [None]
    value = {(r["case"], r["provider"]): r[metric] for r in rows}
    fig, axes = plt.subplots(1, len(ours), figsize=(6.5 * len(ours), 1.2 + 0.32 * len(cases) * (1 + len(peers)) / 2),
                             squeeze=False, sharey=True)
    for ax, backend in zip(axes[0], ours):
        shown = ([backend] if backend else []) + peers
        height = 0.8 / max(1, len(shown))
        for i, provider in enumerate(shown):
            ys = [c + i * height for c in range(len(cases))]
            ax.barh(ys, [value.get((case, provider), 0) for case in cases], height, label=provider)
        ax.axvline(100, color="grey", lw=0.6)
        ax.set_title(backend or "peers", fontsize=9)
        ax.set_xlabel("% of the case's floor (higher is better)" if gpu else "% of a same-bytes copy")
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_yticks([c + 0.4 - 0.4 / max(1, len(peers) + 1) for c in range(len(cases))])
    axes[0][0].set_yticklabels([textwrap.shorten(c, 30) for c in cases], fontsize=7)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"rope_ops bench: {textwrap.shorten(platform_line(results), 150)}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
