"""``python -m rope_ops info``: the backends on this machine, readable (``--json`` for tools).

What it reports: each registered backend, whether it can run here and why not, whether it joins
automatic selection (rope_ops' own do; a third-party backend only when it sets
``joins_auto = True``) and what it supports; what a typical call gets on each visible device
under the backend request in force (``ROPE_OPS_BACKEND``), or the error such a call raises; and
plugin problems (entry points ignored, backends that failed to load).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re

import torch

from . import _select, registry
from ._errors import BackendError
from .backend import RopeCall

_PROBE_DTYPE = {"cpu": torch.float32}
_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
# Raw texts some libraries put in their errors, and what they mean to a reader of this report.
_READABLE = (
    ("0 active drivers", "no GPU driver for Triton (Triton found no CUDA or ROCm device and driver)"),
)


def visible_devices() -> list[str]:
    devices = ["cpu"]
    for name in ("cuda", "npu", "xpu", "mps"):
        module = getattr(torch, name, None)
        try:
            if module is not None and module.is_available():
                devices.append(name)
        except Exception:  # a broken device runtime is reported by its backend, not here
            pass
    return devices


def probe_call(device_type: str, **changes) -> RopeCall:
    """A typical call to report selection for: Llama-like prefill, bf16 (float32 on the CPU), bshd,
    NeoX, head_dim 128, 32 q / 8 k heads, int64 positions, no gradient."""
    call = RopeCall(device_type, _PROBE_DTYPE.get(device_type, torch.bfloat16), "bshd", "neox", 128, 128,
                    32, 8, False, torch.int64, False, False, True)
    return call._replace(**changes)


def readable(text: str) -> str:
    """``text`` with each line that carries a known raw library error replaced by its meaning
    (keeping a leading "name: " label)."""
    lines = []
    for line in text.splitlines() or [text]:
        for raw, meaning in _READABLE:
            if raw in line:
                label = re.match(r"^(\s*[\w.-]+: )", line)
                line = (label.group(1) if label and raw not in label.group(1) else "") + meaning
                break
        lines.append(line)
    return "\n".join(lines)


def _distributions() -> dict[str, tuple[str | None, str]]:
    """Backend name -> (distribution, entry point value) of the entry points in our group."""
    found = {}
    try:
        for ep in importlib.metadata.entry_points(group=registry.NAMESPACE):
            dist = getattr(getattr(ep, "dist", None), "name", None)
            found.setdefault(ep.name, (dist, ep.value))
    except Exception:  # metadata unreadable: the report still lists the backends
        pass
    return found


def _capabilities(backend) -> dict:
    try:
        return backend.describe()
    except Exception as error:
        return {"error": f"describe() raised {registry.describe_error(error)}"}


def _selection(request: str, device_type: str) -> dict:
    call = probe_call(device_type)
    try:
        return {"backend": _select.decide(request, call).name}
    except BackendError as error:
        return {"backend": None, "error": readable(f"BackendError: {error}")}
    except Exception as error:  # report, never crash: info is a diagnostic tool
        return {"backend": None, "error": f"{type(error).__name__}: {error}"}


def collect() -> dict:
    import rope_ops

    loaded, failures = registry.load_all()
    distributions = _distributions()
    backends = {}
    for name in registry.names():
        builtin = registry.is_builtin(name)
        dist, target = distributions.get(name, (None, None))
        entry = {"builtin": builtin, "distribution": dist, "entry_point": target}
        if name in failures:
            entry.update(state="failed to load", available=False, joins_auto=builtin,
                         reasons=[readable(f"failed to load: {failures[name]}")])
        else:
            backend = loaded[name]
            reasons = [readable(r) for r in registry.availability(backend)]
            try:
                auto_devices = sorted(backend.auto_devices())
            except Exception as error:
                auto_devices, reasons = [], reasons + [f"auto_devices() raised {registry.describe_error(error)}"]
            entry.update(state="unavailable" if reasons else "available", available=not reasons,
                         joins_auto=_select.joins_auto(backend), auto_devices=auto_devices,
                         fallback=name == _select.FALLBACK, reasons=reasons, capabilities=_capabilities(backend))
        backends[name] = entry
    problems = [f"ignored entry point: {why}" for why in registry.shadowed().values()]
    problems += [f"backend {name!r} failed to load: {why}" for name, why in failures.items()]
    env_request = os.environ.get(_select.ENV_VAR)
    request = _select.current_request()
    devices = visible_devices()
    return {
        "versions": {"rope_ops": rope_ops.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "triton": _version("triton"), "python": platform.python_version(),
                     "machine": platform.machine()},
        "devices": devices,
        "request": {"value": request, "from": _select.ENV_VAR if env_request else "default",
                    "forced": request.strip() != "auto"},
        "selection": {d: _selection(request, d) for d in devices},
        "auto_selection": {d: _selection("auto", d) for d in devices},
        "backends": backends,
        "problems": problems,
        "environment": {k: v for k, v in os.environ.items() if k.startswith("ROPE_OPS") or k == "TRITON_INTERPRET"},
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _summary(caps: dict) -> str:
    if "error" in caps:
        return caps["error"]
    dtypes = ", ".join(_DTYPE_SHORT.get(d, d) for d in caps.get("dtypes", []))
    layouts = caps.get("layouts", [])
    layouts = "all layouts" if set(layouts) >= {"bshd", "sbhd", "bhsd", "thd"} else "layouts " + ", ".join(layouts)
    low, high = caps.get("head_dim", [None, None])
    head = f"head_dim {low}..{high}" if high is not None and high < (1 << 30) else f"head_dim >= {low}"
    flags = [label for key, label in (("backward", "backward"), ("inplace", "in place"),
                                      ("caller_tables", "caller cos/sin tables"),
                                      ("prologue", "fused prologue")) if caps.get(key)]
    angles = caps.get("angles")
    angles = "angles from " + ", ".join(angles) if angles else ""
    extras = [f"{k}: {v}" for k, v in caps.items()
              if k not in ("priority", "devices", "auto_devices", "dtypes", "layouts", "styles", "head_dim",
                           "backward", "inplace", "caller_tables", "prologue", "angles")
              and isinstance(v, (str, int, float, bool))]
    parts = [f"devices {', '.join(caps.get('devices', []))}", dtypes, layouts,
             "styles " + ", ".join(caps.get("styles", [])), head, angles, *flags, *extras]
    return "; ".join(p for p in parts if p)


def _request_lines(report: dict) -> list[str]:
    request = report["request"]
    if not request["forced"]:
        return ["Backend request: auto (ROPE_OPS_BACKEND not set): the best available backend for the "
                "tensors' device, the torch backend as the last resort."]
    value = request["value"]
    names = [n.strip() for n in value.split(",") if n.strip()]
    where = f"{request['from']}={value}" if request["from"] != "default" else f"request {value!r}"
    unknown = [n for n in names if n != "auto" and n not in report["backends"]]
    if unknown:
        return [f"Backend request: {where} names backend(s) {unknown} that are not registered: every call "
                "raises BackendError (registered: " + ", ".join(report["backends"]) + ")."]
    if len(names) == 1:
        return [f"Backend request: {where} forces backend {names[0]!r} for every call: no fallback; a call "
                "it cannot run raises BackendError."]
    return [f"Backend request: {where}: the first of {names} that can run each call; BackendError when none can."]


def render(report: dict) -> str:
    v = report["versions"]
    lines = [f"rope_ops {v['rope_ops']}  torch {v['torch']} ({'CUDA ' + v['cuda'] if v['cuda'] else 'no CUDA'})"
             f"{'  triton ' + v['triton'] if v['triton'] else ''}  Python {v['python']}  {v['machine']}",
             f"Devices visible to torch: {', '.join(report['devices'])}", ""]
    lines += _request_lines(report)
    what = "A typical call (Llama-like prefill: bshd, 32 q / 8 k heads, head_dim 128, bf16; float32 on the cpu)"
    lines.append(f"{what} gets:")
    for device, got in report["selection"].items():
        if got["backend"]:
            lines.append(f"  {device:5s} -> {got['backend']}")
        else:
            lines.append(f"  {device:5s} -> error, as a real call would raise:")
            lines += [f"           {line}" for line in got["error"].splitlines()]
        if report["request"]["forced"]:
            auto = report["auto_selection"][device]
            lines.append(f"           (automatic selection would pick: {auto['backend'] or 'none'})")
    lines += ["", "Backends (rope_ops' own join automatic selection; a third-party backend joins only if it "
                  "sets joins_auto = True):"]
    for name, entry in report["backends"].items():
        origin = "built-in" if entry["builtin"] else f"third-party ({entry.get('distribution') or 'unknown distribution'})"
        if entry["state"] == "failed to load":
            auto = ""
        elif entry["joins_auto"]:
            devices = ", ".join(entry.get("auto_devices", [])).replace("*", "every device") or "no device"
            auto = f", joins automatic selection on {devices}" + (" (the fallback)" if entry.get("fallback") else "")
        else:
            auto = ", does not join automatic selection: use it by name (ROPE_OPS_BACKEND, backend=)"
        priority = entry.get("capabilities", {}).get("priority")
        lines.append(f"  {name:9s} {entry['state']:12s} {origin}{auto}"
                     + (f"; priority {priority}" if priority is not None else ""))
        for reason in entry["reasons"]:
            lines.append(f"            - {reason}")
        if "capabilities" in entry:
            lines.append(f"            {_summary(entry['capabilities'])}")
    lines += ["", "Plugin problems:"]
    lines += [f"  - {p}" for p in report["problems"]] or ["  none"]
    if report["environment"]:
        lines += ["", "Environment: " + ", ".join(f"{k}={v}" for k, v in sorted(report["environment"].items()))]
    return "\n".join(lines)


def main(json_output: bool = False) -> int:
    report = collect()
    print(json.dumps(report, indent=2, default=str) if json_output else render(report))
    return 0
