"""The command line: ``python -m rope_ops {info,bench} [options]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

_DESCRIPTION = """\
rope_ops: Rotary Position Embedding for PyTorch, one op contract, pluggable backends.

commands:
  info    the backends on this machine: which can run and why not, which join automatic
          selection, what a call gets (ROPE_OPS_BACKEND included), plugin problems
  bench   benchmark rope_ops' backends and peers against floors measured in the same run
"""


def _names_block(title: str, cases, width: int = 96) -> str:
    lines = [f"{title}:"]
    for case in cases.values():
        lines.append(f"  {case.name:28s} {case.title}")
        lines.append(textwrap.indent(textwrap.fill(case.describe(), width - 31, break_on_hyphens=False), " " * 31))
    return "\n".join(lines)


def _bench_epilog() -> str:
    from .bench.cases import CPU_WORKLOADS, MATRIX, WORKLOADS

    return "\n\n".join([
        _names_block("workloads (PERF.md; the default on a GPU)", WORKLOADS),
        _names_block("CPU workloads (the default on a CPU)", CPU_WORKLOADS),
        _names_block(f"matrix cases ({len(MATRIX)}; --matrix runs them after W1-W5)", MATRIX),
        "providers: rope_ops backends by name (cuda, triton, cpu, torch, ascend, or a plugin's name), "
        "liger (Liger-Kernel's Triton rope), hf-compile (torch.compile of Hugging Face's eager form), "
        "hf-eager. Defaults: cuda,triton,liger,hf-compile,hf-eager on a GPU; cpu,torch,hf-eager,hf-compile "
        "on a CPU.",
        "exit status: 1 when a rope_ops provider errors or its outputs fail the check against the float64 "
        "reference (targets not met are reported, not failed), 2 for a bad command line.",
    ])


def _top_epilog() -> str:
    from .bench.cases import CPU_WORKLOADS, MATRIX, WORKLOADS

    names = lambda cases: textwrap.fill(", ".join(cases), 92, initial_indent="  ", subsequent_indent="  ",  # noqa: E731
                                        break_on_hyphens=False)
    return "\n".join([
        "bench workloads:", names(WORKLOADS), "CPU workloads:", names(CPU_WORKLOADS),
        "matrix cases:", names(MATRIX), "",
        "examples:",
        "  python -m rope_ops info",
        "  python -m rope_ops bench --providers torch",
        "  python -m rope_ops bench --matrix --json out.json --markdown results.md --png chart.png",
        "  python -m rope_ops <command> --help    (every option of a command)",
    ])


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="python -m rope_ops", description=_DESCRIPTION, epilog=_top_epilog(),
                                     formatter_class=raw)
    sub = parser.add_subparsers(dest="command", metavar="{info,bench}")
    info = sub.add_parser(
        "info", help="report the backends on this machine", formatter_class=raw,
        description=textwrap.fill(
            "Every registered backend: whether it can run here and why not, whether it joins automatic "
            "selection, its capabilities; what a typical call gets on each visible device (under "
            "ROPE_OPS_BACKEND when set, or the error such a call would raise); plugin problems (entry "
            "points ignored, load failures).", 92))
    info.add_argument("--json", action="store_true", help="print the report as JSON instead of text")

    bench = sub.add_parser(
        "bench", help="benchmark backends and peers", formatter_class=raw, epilog=_bench_epilog(),
        description=textwrap.fill(
            "Time rope_ops' backends and peers on PERF.md's workloads (default) or the public matrix, each "
            "case against its floor measured in the same run, with every provider's outputs checked against "
            "the float64 reference. GPU: CUDA-graph time and host time per eager call. CPU: medians and "
            "spread of repeated loops, allocator warmed.", 92))
    bench.add_argument("--workloads", metavar="NAMES",
                       help="comma list of workload / case names (listed below); default: W1-W5 (with "
                            "W3 in place, W3i) on a GPU, the CPU workloads on a CPU")
    bench.add_argument("--matrix", action="store_true", help="run W1-W5 and every matrix case")
    bench.add_argument("--candidates", action="store_true",
                       help="instead of the providers, time every kernel candidate the cuda and triton "
                            "backends expose (kernel_candidates / run_with) on each case (default cases: "
                            "W1-W5 and the matrix) and report the policy's choice against the best")
    bench.add_argument("--providers", metavar="NAMES", help="comma list of providers (listed below)")
    bench.add_argument("--device", choices=("cuda", "cpu"), default=None,
                       help="where to run (default: cuda when available, else cpu)")
    bench.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                       help="run every case in this dtype instead of its own")
    bench.add_argument("--scale", type=_positive_int, default=None,
                       help="divide sequence lengths by this (default: 1; on a CPU, 32 for the GPU-sized "
                            "workloads and matrix cases)")
    bench.add_argument("--sets", type=_positive_int, default=None,
                       help="input sets to rotate through, at least (default: 4 on a GPU, raised until they "
                            "exceed 3x the L2; 2 on a CPU)")
    bench.add_argument("--repeats", type=_positive_int, default=None,
                       help="GPU: graph replays per timing, median taken (default 5); CPU: timed loops per "
                            "provider, median and spread shown (default 7)")
    bench.add_argument("--time-ms", type=_positive_float, default=None,
                       help="GPU: GPU time captured per graph (default 20; 5 for --candidates); CPU: time "
                            "per timed loop (default 50)")
    bench.add_argument("--threads", type=_positive_int, default=None,
                       help="CPU threads (torch.set_num_threads; default: torch's)")
    bench.add_argument("--no-host", action="store_true",
                       help="skip host time per eager call (W2, W4; GPU only)")
    bench.add_argument("--json", metavar="PATH", help="write every result as JSON (rewritten after each case)")
    bench.add_argument("--render", metavar="PATHS",
                       help="run nothing: read results JSON file(s) of earlier runs (a comma list is merged "
                            "into one report) and print / write them (--markdown, --png, --json)")
    bench.add_argument("--markdown", metavar="PATH",
                       help="write the results file: platform, versions, commit, date, method, tables")
    bench.add_argument("--png", metavar="PATH",
                       help="write a chart (needs matplotlib: pip install 'rope_ops[bench]')")
    return parser, {"info": info, "bench": bench}


def _check_png(args, parser: argparse.ArgumentParser) -> None:
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--png needs matplotlib, which is not installed: pip install 'rope_ops[bench]' "
                         "(the [bench] extra)")


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def bench_options(args, parser: argparse.ArgumentParser):
    """Options for the run, from the parsed arguments; every argument error is reported here,
    before anything runs (parser.error exits with status 2)."""
    import torch

    from .bench import providers as providers_mod
    from .bench.cases import ALL_CASES, CPU_WORKLOADS, MATRIX, WORKLOADS, scaled, with_dtype
    from .bench.run import Options

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to torch here")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.matrix and args.workloads:
        parser.error("give --matrix or --workloads, not both")
    if args.workloads is not None:
        names = _split(args.workloads)
        unknown = [n for n in names if n not in ALL_CASES]
        if unknown or not names:
            parser.error(f"--workloads: unknown name(s) {', '.join(unknown) or repr(args.workloads)}; valid: "
                         f"{', '.join(ALL_CASES)}")
        cases = [ALL_CASES[n] for n in dict.fromkeys(names)]
    elif args.matrix or args.candidates:
        cases = list(WORKLOADS.values()) + list(MATRIX.values())
    else:
        cases = list((WORKLOADS if device.type == "cuda" else CPU_WORKLOADS).values())
    valid = providers_mod.valid_names()
    if args.providers is not None:
        wanted = [providers_mod.canonical(n) for n in _split(args.providers)]
        unknown = [n for n in wanted if n not in valid]
        if unknown or not wanted:
            parser.error(f"--providers: unknown provider(s) {', '.join(unknown) or repr(args.providers)}; "
                         f"valid: {', '.join(valid)}")
        wanted = list(dict.fromkeys(wanted))
    else:
        wanted = list(providers_mod.GPU_DEFAULT if device.type == "cuda" else providers_mod.CPU_DEFAULT)
    if args.candidates and device.type != "cuda":
        parser.error("--candidates: kernel candidates are the cuda and triton backends'; they need a CUDA device")
    out = []
    for case in cases:
        scale = args.scale or (32 if device.type == "cpu" and case.group != "cpu" else 1)
        out.append(with_dtype(scaled(case, scale), args.dtype))
    return Options(cases=out, providers=wanted, device=device, sets=args.sets, repeats=args.repeats,
                   time_ms=args.time_ms, host=not args.no_host, candidates=args.candidates, threads=args.threads)


def _load_results(paths: str, parser: argparse.ArgumentParser) -> dict:
    from .bench.run import merge

    parts = []
    for path in _split(paths):
        try:
            with open(path) as f:
                parts.append(json.load(f))
        except (OSError, ValueError) as error:
            parser.error(f"--render: cannot read results from {path}: {error}")
    if not parts:
        parser.error("--render: no file given")
    return merge(parts)


def _write_json(path: str, results: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def bench_main(args, parser: argparse.ArgumentParser) -> int:
    from .bench import report
    from .bench.run import failures, run

    _check_png(args, parser)
    if args.render:
        results = _load_results(args.render, parser)
    else:
        options = bench_options(args, parser)
        if args.json:
            options.after_case = lambda partial: _write_json(args.json, partial)
        results = run(options)
    print(report.render(results))
    if args.json:
        _write_json(args.json, results)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown(results))
    if args.png and results.get("rows"):
        report.plot(results, args.png)
    bad = failures(results)
    for line in bad:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = build_parser()
    if not argv:
        parser.print_help()
        return 2
    try:
        args = parser.parse_args(argv)
        if args.command == "info":
            from . import info

            return info.main(json_output=args.json)
        if args.command == "bench":
            return bench_main(args, commands["bench"])
        parser.print_help()
        return 2
    except SystemExit as exit_:  # argparse: --help (0) and usage errors (2)
        return exit_.code if isinstance(exit_.code, int) else 2
