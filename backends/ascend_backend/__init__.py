"""The Ascend NPU backend: three tiers, chosen per call in ``run``.

1. ``kernels``: rope_ops' own Ascend C kernels (ascend_kernels/), when their library has been
   built on this machine and loads: ops ``torch.ops.rope_ops_ascend.rotary_embedding[_grad]`` and
   ``qkv_prologue[_grad]``. Any layout, strides (stride 1 on head_dim), GQA, partial rotary, in
   place, any position (out-of-table rows computed on the fly in the kernel), one launch for q and
   k; every angle source (tables by position, row-strided and fp16/bf16 included; cos/sin per
   token; mRoPE) and the fused prologue (q and KV caches in qkv's dtype).
2. ``npu_rotary_mul``: ``torch_npu.npu_rotary_mul`` (CANN's fused RotaryPositionEmbedding), only
   for rotations inside its documented limits (limits.py, checked in Python first). rope_ops builds
   per-token cos/sin rows (``cos_sin_rows``: never reads outside the table), expands them to the
   full width the op expects (neox: cat(c, c), mode "half"; gptj: c.repeat_interleave(2), mode
   "interleave"), and rotates the first rotary_dim dims; the tail is copied (or kept in place).
   It runs in float32 (x is upcast, then rounded once into the output) because torch_npu casts
   r1/r2 to x's dtype: fp16/bf16 cos/sin would break SPEC's one-ulp accuracy.
   The backward (``inverse=True``, called by rope_ops on the output gradients) is the same op
   with sin negated: the gradient of a rotation is the rotation by minus the angle. We do not use
   ``torch.ops.npu.npu_rotary_mul_backward``: it computes the same dx through
   aclnnRotaryPositionEmbeddingGrad but has extra limits (B < S for B1SD/BS1D cos, B*N <= 1024
   once x is passed), and rope_ops' autograd never needs dcos/dsin. It has no prologue.
3. ``torch``: the pure-torch backend's ``run`` on the npu device (always possible), and the
   prologue in torch ops (``prologue_forward_torch`` / ``prologue_backward_torch``), e.g. for a
   float8 KV cache or a float8 q (q_scale).

Importing this module imports neither torch_npu nor any kernel library; ``availability()`` does,
once, in a worker thread bounded by ``ROPE_OPS_ASCEND_PROBE_TIMEOUT``: whatever the import or the
driver does (raise anything, hang), ``availability()`` returns reasons and never raises or hangs.
Configuration errors (a bad variable below) are reasons too, and a BackendError from ``run``,
raised before anything is written.

Environment:
  ROPE_OPS_ASCEND_TIERS     allowed tiers, comma list of kernels,npu_rotary_mul,torch (default all)
  ROPE_OPS_ASCEND_LIB       path of the built kernel library (default: see ``library_candidates``)
  ROPE_OPS_ASCEND_UB_SIZE   unified-buffer bytes per vector core for the kernels' tiling
                            (default 196608, Atlas A2/A3)
  ROPE_OPS_ASCEND_CORES     vector cores to split rows over (default: the device's vector_core_num)
  ROPE_OPS_ASCEND_PROBE_TIMEOUT  seconds the first probe of torch_npu and the NPU may take
                            (default 120)
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from rope_ops import BackendError
from rope_ops.backend import (Backend, KernelArgs, PrologueArgs, RopeCall, bshd_view, cos_sin_rows,
                              positions_bs, prologue_backward_torch, prologue_forward_torch)

from . import _kernel_call as kc
from . import limits as _limits

TIERS = ("kernels", "npu_rotary_mul", "torch")
LIB_NAME = "librope_ops_ascend.so"
DEFAULT_UB_SIZE = 196608  # Atlas A2/A3 (dav-2201): 192 KiB of UB per AI vector core
DEFAULT_CORES = 40
DEFAULT_PROBE_TIMEOUT = 120.0
BUILD_COMMAND = "bash ascend_kernels/build.sh"

_lock = threading.Lock()


def library_candidates() -> list[Path]:
    """Where a built kernel library is looked for, in order."""
    out = []
    env = os.environ.get("ROPE_OPS_ASCEND_LIB")
    if env:
        out.append(Path(env).expanduser())
    try:
        from .._paths import source_dir

        out.append(source_dir("ascend_kernels") / "build" / LIB_NAME)
    except FileNotFoundError:
        pass
    cache = os.environ.get("ROPE_OPS_CACHE")
    try:
        root = Path(cache).expanduser() if cache else Path.home() / ".cache" / "rope_ops"
    except RuntimeError:  # no home directory to expand
        return out
    out.append(root / "ascend" / LIB_NAME)
    return out


def _built_libraries() -> list[Path]:
    """The candidates that exist (an unreadable directory counts as not there)."""
    found = []
    for path in library_candidates():
        try:
            if path.is_file():
                found.append(path)
        except OSError:
            pass
    return found


def _short(e: BaseException, n: int = 400) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= n else text[: n - 3] + "..."


class Config(NamedTuple):
    """The ROPE_OPS_ASCEND_* variables, parsed."""

    tiers: tuple[str, ...]  # allowed tiers, in TIERS order
    ub_size: int
    cores: int | None  # None: the device's vector core count
    probe_timeout: float


CONFIG_VARS = ("ROPE_OPS_ASCEND_TIERS", "ROPE_OPS_ASCEND_UB_SIZE", "ROPE_OPS_ASCEND_CORES",
               "ROPE_OPS_ASCEND_PROBE_TIMEOUT")
_configs: dict[tuple, Config] = {}  # by the variables' raw values: parsed once, read per call


def _number(name: str, raw: str | None, default, kind, minimum, errors: list[str]):
    """raw as a number >= minimum, the default when unset; an error naming the variable when set
    to anything else (a typo must not silently become the default)."""
    raw = (raw or "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value >= minimum:
        errors.append(f"{name}={raw!r}: expected {'an integer' if kind is int else 'a number'} >= {minimum}")
        return default
    return value


def config() -> Config:
    """The configuration in force; BackendError naming every bad variable."""
    raw = tuple(os.environ.get(name) for name in CONFIG_VARS)
    found = _configs.get(raw)
    if found is not None:
        return found
    errors: list[str] = []
    tiers_raw = (raw[0] or "").strip()
    if not tiers_raw or tiers_raw == "auto":
        tiers = TIERS
    else:
        names = [t.strip() for t in tiers_raw.split(",") if t.strip()]
        unknown = [t for t in names if t not in TIERS]
        if unknown or not names:
            errors.append(f"ROPE_OPS_ASCEND_TIERS={tiers_raw!r} names unknown tiers {unknown}; "
                          f"expected a comma list of {', '.join(TIERS)}")
        tiers = tuple(t for t in TIERS if t in names)
    found = Config(tiers, _number(CONFIG_VARS[1], raw[1], DEFAULT_UB_SIZE, int, 1, errors),
                   _number(CONFIG_VARS[2], raw[2], None, int, 1, errors),
                   _number(CONFIG_VARS[3], raw[3], DEFAULT_PROBE_TIMEOUT, float, 0, errors))
    if errors:
        raise BackendError("ascend backend: " + "; ".join(errors))
    if len(_configs) >= 64:
        _configs.clear()
    _configs[raw] = found
    return found


def config_errors() -> list[str]:
    """What is wrong with the ROPE_OPS_ASCEND_* variables (empty: nothing)."""
    try:
        config()
    except BackendError as error:
        return [str(error)]
    return []


class KernelOps(NamedTuple):
    """The ops of the kernel library (rope_host.cpp), or stand-ins with their signatures."""

    rotary_embedding: object
    rotary_embedding_grad: object
    qkv_prologue: object
    qkv_prologue_grad: object


class _Env:
    """What this process has: torch_npu, devices, kernels. Probed once, lazily."""

    def __init__(self):
        self.torch_npu = None
        self.reasons: list[str] = []
        self.device_count = 0
        self.kernel_ops: KernelOps | None = None  # once loaded
        self.kernel_status = "not probed"
        self.rotary_mul = None

    @classmethod
    def failed(cls, reason: str) -> _Env:
        env = cls()
        env.reasons.append(reason)
        env.kernel_status = "not loaded (the probe failed)"
        return env


def _import_torch_npu():
    """(module, None) or (None, reason). Never raises: a broken install can raise anything from
    its import (ImportError/OSError without CANN, AttributeError against another torch...)."""
    if "torch_npu" in sys.modules and sys.modules["torch_npu"] is not None:
        return sys.modules["torch_npu"], None
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None, "torch_npu is not installed (pip install torch-npu matching this torch, on a machine with CANN)"
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device)
    except BaseException as e:  # SystemExit included: an import must not end the process
        if isinstance(e, KeyboardInterrupt):
            raise
        if (isinstance(e, ValueError) and "main thread" in str(e)
                and threading.current_thread() is not threading.main_thread()):
            raise  # the prober retries in the calling thread
        return None, ("torch_npu is installed but failed to import; CANN libraries missing or not "
                      f"sourced (source <CANN>/set_env.sh), or a torch_npu built for another torch: "
                      f"{_short(e)}")
    return torch_npu, None


class AscendBackend(Backend):
    name = "ascend"
    priority = 20
    device_types = frozenset({"npu"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    # Every angle source and table dtype: the kernels' cos/sin sources (KERNEL_ANGLES) and the
    # npu_rotary_mul and torch tiers (their cos/sin rows come from rope_ops.backend.cos_sin_rows).
    angle_kinds = frozenset({"table", "token", "mrope"})
    table_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    # The fused prologue: the kernels (q and caches in qkv's dtype) or the torch tier (float8 too).
    supports_prologue = True
    prologue_cache_dtypes = frozenset(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
    prologue_q_dtypes = prologue_cache_dtypes  # float8 q (q_scale): the torch tier, as the float8 cache

    def __init__(self):
        self._env: _Env | None = None
        self._torch_backend = None
        self._core_num: dict[int, int] = {}
        self._soc: dict[int, str | None] = {}
        self.tier_counts = {t: 0 for t in TIERS}  # calls served per tier (for info and tests)
        self.last_tier: str | None = None
        self.last_reasons: dict[str, list[str]] = {}

    # ---------------------------------------------------------------- environment
    def _probe(self) -> _Env:
        """What this process has, probed once. Never raises, never waits longer than the probe
        timeout (a hanging import or driver becomes a reason; its thread is left behind)."""
        env = self._env
        if env is not None:
            return env
        with _lock:
            if self._env is None:
                self._env = self._probe_in_worker()
            return self._env

    def _probe_in_worker(self) -> _Env:
        try:
            timeout = config().probe_timeout
        except BackendError:
            timeout = DEFAULT_PROBE_TIMEOUT  # availability() reports the bad value
        outcome: dict = {}

        def probe():
            try:
                outcome["env"] = self._probe_now()
            except BaseException as error:  # reported as a reason, whatever it is
                outcome["error"] = error

        worker = threading.Thread(target=probe, daemon=True, name="rope_ops-ascend-probe")
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            return _Env.failed(f"probing torch_npu and the NPU did not finish within {timeout:g} s "
                               "(ROPE_OPS_ASCEND_PROBE_TIMEOUT); is `import torch_npu` or the NPU "
                               "driver hanging?")
        error = outcome.get("error")
        if isinstance(error, ValueError) and "main thread" in str(error):
            # An import that must run in the main thread (signal handlers): probe right here,
            # without the timeout; called from another thread, it fails again with a reason.
            try:
                return self._probe_now()
            except Exception as again:
                error = again
        if error is not None:
            return _Env.failed(f"probing torch_npu and the NPU failed: {_short(error)}")
        return outcome["env"]

    def _probe_now(self) -> _Env:
        env = _Env()
        mod, why = _import_torch_npu()
        if mod is None:
            env.reasons.append(why)
            built = _built_libraries()
            env.kernel_status = ("not loaded (torch_npu unavailable); " +
                                 (f"built at {built[0]}" if built else "not built"))
            return env
        env.torch_npu = mod
        env.rotary_mul = getattr(mod, "npu_rotary_mul", None)
        npu = getattr(torch, "npu", None)
        try:
            env.device_count = int(npu.device_count()) if npu is not None and npu.is_available() else 0
        except Exception as e:  # driver missing, broken runtime
            env.reasons.append(f"torch.npu is not usable: {_short(e)}")
            env.device_count = 0
        else:
            if env.device_count == 0:
                vis = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
                extra = f" (ASCEND_RT_VISIBLE_DEVICES={vis!r})" if vis is not None else ""
                env.reasons.append(f"no NPU device visible{extra}")
        self._load_kernels(env)
        return env

    def _load_kernels(self, env: _Env) -> None:
        if not self._tier_allowed("kernels"):
            env.kernel_status = "disabled by ROPE_OPS_ASCEND_TIERS"
            return
        existing = _built_libraries()
        if not existing:
            env.kernel_status = (f"not built (no {LIB_NAME} in "
                                 f"{', '.join(str(p.parent) for p in library_candidates())}; "
                                 f"build with `{BUILD_COMMAND}` on a machine with CANN)")
            return
        path = existing[0]
        try:
            torch.ops.load_library(str(path))
            ns = torch.ops.rope_ops_ascend
            env.kernel_ops = KernelOps(ns.rotary_embedding.default, ns.rotary_embedding_grad.default,
                                       ns.qkv_prologue.default, ns.qkv_prologue_grad.default)
            env.kernel_status = f"loaded from {path}"
        except Exception as e:
            env.kernel_status = f"failed to load {path}: {_short(e)}"

    def availability(self) -> list[str]:
        try:
            reasons = config_errors()
            env = self._probe()
        except Exception as error:  # never raise: say why instead
            return [f"ascend backend: {_short(error)}"]
        if not env.reasons:
            return reasons
        return reasons + list(env.reasons) + [f"(own Ascend C kernels: {env.kernel_status})"]

    def supports(self, call: RopeCall) -> list[str]:
        reasons = super().supports(call)
        if reasons:
            return reasons
        # Without the torch tier, say from metadata when no allowed tier can take such calls
        # (shape limits of the other tiers are only known per call: run() raises for those).
        try:
            tiers = config().tiers
        except BackendError as error:
            return [str(error)]
        if "torch" in tiers:
            return []
        env = self._probe()
        why = []
        if "kernels" in tiers:
            kernel_why = kc.call_reasons(call.angles, call.table_dtype)
            if call.op == "prologue" and call.cache_dtype not in (None, call.dtype):
                kernel_why.append(f"kernels: KV cache of dtype {call.cache_dtype}")
            if call.op == "prologue" and call.q_out_dtype is not None:
                kernel_why.append(f"kernels: q output of dtype {call.q_out_dtype} (the kernels write q in qkv's dtype)")
            if env.kernel_ops is None:
                why.append(f"kernels: {env.kernel_status}")
            elif not call.last_dim_contiguous:
                why.append("kernels: needs stride 1 on head_dim")
            elif kernel_why:
                why += kernel_why
            else:
                return []
        if "npu_rotary_mul" in tiers and call.op == "prologue":
            why.append("npu_rotary_mul: no fused prologue")
        elif "npu_rotary_mul" in tiers:
            if env.rotary_mul is None:
                why.append("npu_rotary_mul: torch_npu.npu_rotary_mul unavailable")
            elif call.rotary_dim >= _limits.MAX_D:
                why.append(f"npu_rotary_mul: rotary_dim {call.rotary_dim} >= {_limits.MAX_D}")
            else:
                return []
        return [f"no tier allowed by ROPE_OPS_ASCEND_TIERS takes this call ({'; '.join(why)})"]

    @staticmethod
    def _tier_allowed(tier: str) -> bool:
        try:
            return tier in config().tiers
        except BackendError:  # reported by availability(); run() raises it
            return False

    def tiers(self) -> list[dict]:
        """Each tier and whether it can serve calls in this process (for ``python -m rope_ops info``)."""
        env = self._probe()  # never raises
        npu_ok = env.torch_npu is not None and env.device_count > 0

        def status(tier, ok, text):
            if not self._tier_allowed(tier):
                return {"tier": tier, "usable": False, "status": "disabled by ROPE_OPS_ASCEND_TIERS"}
            return {"tier": tier, "usable": bool(ok), "status": text}

        rm = ("available (inside its documented limits)" if env.rotary_mul is not None
              else "torch_npu unavailable" if env.torch_npu is None else "torch_npu has no npu_rotary_mul")
        return [
            status("kernels", npu_ok and env.kernel_ops is not None, env.kernel_status),
            status("npu_rotary_mul", npu_ok and env.rotary_mul is not None, rm),
            status("torch", npu_ok, "available" if npu_ok else "; ".join(env.reasons) or "no NPU"),
        ]

    def describe(self) -> dict:
        d = super().describe()
        d["tiers"] = self.tiers()
        d["tier_counts"] = dict(self.tier_counts)
        return d

    # ---------------------------------------------------------------- per-call choice
    def _device_index(self, t: torch.Tensor) -> int:
        idx = t.device.index
        if idx is None:
            try:
                idx = int(torch.npu.current_device())
            except Exception:
                idx = 0
        return idx

    def _cores(self, t: torch.Tensor) -> int:
        env_cores = config().cores
        if env_cores is not None:
            return env_cores
        idx = self._device_index(t)
        if idx not in self._core_num:
            n = 0
            try:
                n = int(getattr(torch.npu.get_device_properties(idx), "vector_core_num", 0))
            except Exception:
                n = 0
            self._core_num[idx] = n if n > 0 else DEFAULT_CORES
        return self._core_num[idx]

    @staticmethod
    def _ub_size() -> int:
        return config().ub_size

    def _soc_name(self, t: torch.Tensor) -> str | None:
        idx = self._device_index(t)
        if idx not in self._soc:
            try:
                self._soc[idx] = str(torch.npu.get_device_name(idx))
            except Exception:
                self._soc[idx] = None
        return self._soc[idx]

    def choose_tier(self, args: KernelArgs) -> tuple[str, dict[str, list[str]]]:
        """(tier, reasons each higher tier was skipped). Metadata only: no data, no sync."""
        tier, skipped, _ = self._choose(args)
        return tier, skipped

    def _choose(self, args: KernelArgs):
        """(tier, skipped reasons, what the tier needs: kernel views or npu_rotary_mul plan).
        BackendError (before anything is written) when no allowed tier can take the call."""
        env = self._probe()
        config()  # a bad variable is a BackendError here, before anything is written
        skipped: dict[str, list[str]] = {}
        views = self._kernel_views(env, skipped, lambda: kc.kernel_views(args),
                                   lambda v: kc.kernel_reasons(v, args.inverse, self._ub_size(), self._cores(args.q)))
        if views is not None:
            return "kernels", skipped, views
        if not self._tier_allowed("npu_rotary_mul"):
            skipped["npu_rotary_mul"] = ["disabled by ROPE_OPS_ASCEND_TIERS"]
        elif env.rotary_mul is None:
            skipped["npu_rotary_mul"] = ["torch_npu.npu_rotary_mul unavailable"]
        else:
            plan, why = self.rotary_mul_plan(args)
            if plan is not None:
                return "npu_rotary_mul", skipped, plan
            skipped["npu_rotary_mul"] = why
        return self._torch_tier(skipped, "call")

    def _kernel_views(self, env: _Env, skipped: dict, views_of, reasons_of):
        """The kernels' views of a call when that tier can take it; else None, with the reasons in
        ``skipped["kernels"]``. ``views_of()`` builds the views, ``reasons_of(views)`` says what
        the kernels cannot take (called only when the kernels are allowed and loaded)."""
        if not self._tier_allowed("kernels"):
            skipped["kernels"] = ["disabled by ROPE_OPS_ASCEND_TIERS"]
            return None
        if env.kernel_ops is None:
            skipped["kernels"] = [env.kernel_status]
            return None
        views = views_of()
        why = reasons_of(views)
        if why:
            skipped["kernels"] = why
            return None
        return views

    def _torch_tier(self, skipped: dict, what: str):
        """The last tier: torch, or a BackendError (before anything is written) when
        ROPE_OPS_ASCEND_TIERS leaves it out."""
        if not self._tier_allowed("torch"):
            raise BackendError("rope_ops ascend backend: no tier allowed by ROPE_OPS_ASCEND_TIERS="
                               f"{os.environ.get('ROPE_OPS_ASCEND_TIERS')!r} can take this {what}: {skipped}",
                               refusals={"ascend": [f"{t}: {'; '.join(r)}" for t, r in skipped.items()]})
        return "torch", skipped, None

    def rotary_mul_plan(self, args: KernelArgs):
        """(plan, []) when npu_rotary_mul can take the call, else (None, reasons).

        plan = (layout, x_shape, cos_shape, shared): layout "BSND" passes q as [1, B*S, H, r]
        (tokens merged, so cos is S-only [1, B*S, 1, r] and B = 1); "BNSD" passes a bhsd tensor
        natively as [B, H, S, r] with cos [1 or B, 1, S, r] where CANN's BNSD rules allow it.
        """
        q = bshd_view(args.q, args.layout)
        b, s, hq, _ = q.shape
        heads = [hq] + ([args.k.shape[-2]] if args.k is not None else [])
        r = args.rotary_dim
        mode = "interleave" if args.interleaved else "half"
        # cos/sin rows shared by the batch: positions given once for all sequences
        shared = args.angles == "table" and (
            args.pos is None or (args.pos.dim() == 1 and args.layout != "thd"))
        soc = self._soc_name(args.q)
        cores = self._cores(args.q)
        if b * s == 0:
            return None, ["no tokens"]
        if args.layout == "bhsd":
            cos_shape = (1 if shared else b, 1, s, r)
            why = []
            for h in heads:
                why += _limits.rotary_mul_reasons((b, h, s, r), cos_shape, layout="BNSD", mode=mode,
                                                  dtype="float32", core_num=cores, soc_name=soc)
            if not why:
                return ("BNSD", cos_shape, shared), []
        why = []
        cos_shape = (1, b * s, 1, r)
        for h in heads:
            why += _limits.rotary_mul_reasons((1, b * s, h, r), cos_shape, layout="BSND", mode=mode,
                                              dtype="float32", core_num=cores, soc_name=soc)
        if why:
            return None, why
        return ("BSND", cos_shape, shared), []

    # ---------------------------------------------------------------- run
    def run(self, args: KernelArgs) -> None:
        if args.q.numel() == 0:
            # q without elements (no heads) and a k with some: k alone is the call.
            if args.k is None or args.k.numel() == 0:
                return
            args = args._replace(q=args.k, q_out=args.k_out, k=None, k_out=None)
        elif args.k is not None and args.k.numel() == 0:
            args = args._replace(k=None, k_out=None)
        tier, skipped, prepared = self._choose(args)
        self._served(tier, skipped)
        if tier == "kernels":
            self._run_kernels(args, prepared)
        elif tier == "npu_rotary_mul":
            self._run_rotary_mul(args, prepared)
        else:
            self._run_torch(args)

    def _run_kernels(self, args: KernelArgs, v) -> None:
        ops = self._probe().kernel_ops
        op = ops.rotary_embedding_grad if args.inverse else ops.rotary_embedding
        op(v.q, v.k, v.q_out, v.k_out, *v.angles.op_args(), v.rotary_dim, v.interleaved, v.inplace,
           self._ub_size(), self._cores(args.q))

    def _run_rotary_mul(self, args: KernelArgs, plan) -> None:
        layout, cos_shape, shared = plan
        rotary_mul = self._probe().rotary_mul
        q = bshd_view(args.q, args.layout)
        b, s = q.shape[0], q.shape[1]
        r = args.rotary_dim
        positions = positions_bs(args, b, s)
        if shared and layout == "BNSD":
            positions = positions[:1]
        c, sn = cos_sin_rows(args, positions)  # float32 [B or 1, S, r/2]
        if args.inverse:
            sn = -sn
        if args.interleaved:
            c, sn = c.repeat_interleave(2, dim=-1), sn.repeat_interleave(2, dim=-1)
            mode = "interleave"
        else:
            c, sn = torch.cat((c, c), dim=-1), torch.cat((sn, sn), dim=-1)
            mode = "half"
        if layout == "BNSD":
            c, sn = c.unsqueeze(1), sn.unsqueeze(1)  # [B|1, 1, S, r]
        else:
            c, sn = c.reshape(cos_shape), sn.reshape(cos_shape)  # [1, B*S, 1, r]
        for x, out in ((args.q, args.q_out), (args.k, args.k_out)):
            if x is None:
                continue
            xv, ov = bshd_view(x, args.layout), bshd_view(out, args.layout)
            h = xv.shape[2]
            if layout == "BNSD":
                x4 = x[..., :r].to(torch.float32)  # native [B, H, S, r]
                y = rotary_mul(x4, c, sn, rotary_mode=mode).transpose(1, 2)
            else:
                x4 = xv[..., :r].to(torch.float32).reshape(1, b * s, h, r)
                y = rotary_mul(x4, c, sn, rotary_mode=mode).view(b, s, h, r)
            ov[..., :r].copy_(y)  # one rounding to the output dtype
            if not args.inplace and r < xv.shape[-1]:
                ov[..., r:].copy_(xv[..., r:])

    def _run_torch(self, args: KernelArgs) -> None:
        if self._torch_backend is None:
            from rope_ops_backends.torch_backend import TorchBackend

            self._torch_backend = TorchBackend()
        self._torch_backend.run(args)

    # ---------------------------------------------------------------- the fused prologue
    def _choose_prologue(self, args: PrologueArgs, grad: bool, views_of):
        """(tier, skipped reasons, kernel views) for the prologue (grad: its backward): the kernels
        when they can take the call (``views_of()`` builds their views), else the torch tier.
        BackendError (before anything is written) when no allowed tier can take it."""
        env = self._probe()
        config()
        skipped: dict[str, list[str]] = {}
        views = self._kernel_views(env, skipped, views_of,
                                   lambda v: kc.prologue_reasons(v, grad, self._ub_size(), self._cores(args.qkv)))
        if views is not None:
            return "kernels", skipped, views
        skipped["npu_rotary_mul"] = (["no fused prologue (norm, cache write)"] if self._tier_allowed("npu_rotary_mul")
                                     else ["disabled by ROPE_OPS_ASCEND_TIERS"])
        return self._torch_tier(skipped, "prologue")

    def _served(self, tier: str, skipped: dict) -> None:
        self.last_tier, self.last_reasons = tier, skipped
        self.tier_counts[tier] += 1

    def run_prologue(self, args: PrologueArgs) -> None:
        tier, skipped, v = self._choose_prologue(args, False, lambda: kc.prologue_views(args))
        self._served(tier, skipped)
        if tier != "kernels":
            prologue_forward_torch(args)
            return
        self._probe().kernel_ops.qkv_prologue(
            v.q, v.k, v.v, v.q_out, v.k_out, v.v_out, *v.angles.op_args(), v.rotary_dim, v.interleaved,
            v.rotate, v.q_weight, v.k_weight, v.eps, v.weight_offset, v.inplace, v.k_cache, v.v_cache, v.slots,
            self._ub_size(), self._cores(args.qkv))

    def run_prologue_backward(self, args: PrologueArgs, grad_q, grad_k, grad_v):
        qkv = args.qkv
        grad_qkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        tier, skipped, v = self._choose_prologue(
            args, True, lambda: kc.prologue_grad_views(args, grad_qkv, grad_q, grad_k, grad_v))
        self._served(tier, skipped)
        if tier != "kernels":
            return prologue_backward_torch(args, grad_q, grad_k, grad_v)
        cores = self._cores(qkv)
        # One row of float32 weight-gradient sums per core, added here in a fixed order.
        sums = [None if w is None else torch.zeros(cores, args.head_dim, device=qkv.device)
                for w in (args.q_weight, args.k_weight)]
        self._probe().kernel_ops.qkv_prologue_grad(
            v.q, v.k, v.v, v.xq, v.xk, v.q_out, v.k_out, v.v_out, *v.angles.op_args(), v.rotary_dim,
            v.interleaved, v.rotate, v.q_weight, v.k_weight, v.eps, v.weight_offset, sums[0], sums[1],
            self._ub_size(), cores)
        return (grad_qkv, None if sums[0] is None else sums[0].sum(0),
                None if sums[1] is None else sums[1].sum(0))
