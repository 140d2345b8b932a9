"""rope_ops as the ``rotary_pos_emb`` kernel of the ``kernels`` package (Hugging Face's kernel hub).

transformers marks ``apply_rotary_pos_emb`` with ``@use_kernel_forward_from_hub("rotary_pos_emb")``
and ``kernelize`` swaps in the layer a kernel mapping names for it. The hub's rotary kernels are
mapped for ``Mode.INFERENCE`` only; this layer has rope_ops' backward (the inverse rotation), so
it serves ``Mode.TRAINING`` and ``Mode.TORCH_COMPILE`` too:

    from kernels import Mode, kernelize, use_kernel_mapping
    from rope_ops.integrations import kernels_hub

    repo = kernels_hub.write_local_repository("rope_ops_kernel")   # once: a local kernel repository
    with use_kernel_mapping(kernels_hub.kernel_mapping(repo)):
        model = kernelize(model, mode=Mode.TRAINING)                # or model.kernelize(mode=...)

The repository is what ``kernels``' ``LocalLayerRepository`` loads: a noarch build variant per
device type, whose module imports this file's ``layers``; it holds no copy of rope_ops. ``python
-m rope_ops.integrations.kernels_hub DIRECTORY`` writes it too (for instance to upload to a hub
repository of your own).
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import types
from pathlib import Path

import torch

from .transformers import rotate_with_tables

LAYER_NAME = "apply_rotary_transformers"  # the name transformers' own mapping uses for this layer
KERNEL_NAME = "rope-ops-rotary"
# Build variants written: noarch, one per device type (and the kernels backend it names).
VARIANTS = {"torch-cpu": "cpu", "torch-cuda": "cuda", "torch-rocm": "rocm", "torch-xpu": "xpu",
            "torch-npu": "cann"}
# Device types of kernel_mapping (the keys kernels' mappings take).
DEVICES = ("cpu", "cuda", "rocm", "xpu", "npu")


class ApplyRotaryTransformers(torch.nn.Module):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` on rope_ops.

    A kernels layer: no state and no constructor (``kernelize`` binds this forward to the
    function's module); ``has_backward`` and ``can_torch_compile`` let it serve every mode.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return rotate_with_tables(q, k, cos, sin, unsqueeze_dim)


# What a kernel module exposes to kernels' layer lookup (``kernel.layers.<layer_name>``).
layers = types.SimpleNamespace(**{LAYER_NAME: ApplyRotaryTransformers})

_INIT = '''"""rope_ops as a kernels layer: the layer lives in rope_ops, which must be installed."""

from rope_ops.integrations.kernels_hub import layers  # noqa: F401
'''


def write_local_repository(directory) -> Path:
    """Write (or refresh) the kernel repository in ``directory`` and return its path.

    Layout: ``build/<variant>/metadata.json`` and ``build/<variant>/__init__.py`` for each of
    VARIANTS; ``kernels.get_local_kernel`` and ``LocalLayerRepository`` load it.
    """
    root = Path(directory)
    digest = _reads_digests()  # kernels then verifies the files against it (and warns without one)
    for variant, backend in VARIANTS.items():
        variant_dir = root / "build" / variant
        variant_dir.mkdir(parents=True, exist_ok=True)
        metadata = {"id": f"_rope_ops_rotary_{variant.replace('-', '_')}", "name": KERNEL_NAME,
                    "version": 1, "license": "Apache-2.0", "python-depends": [],
                    "backend": {"type": backend}}
        if digest:
            metadata["digest"] = {"algorithm": "sha256", "files": {"__init__.py": _sha256_b64(_INIT.encode())}}
        (variant_dir / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        (variant_dir / "__init__.py").write_text(_INIT)
    return root


def _reads_digests() -> bool:
    """Whether the installed kernels reads a build variant's digest (0.19 and later; earlier
    versions may refuse a metadata field they do not know)."""
    try:
        import kernels
    except ImportError:
        return False
    return hasattr(getattr(kernels, "Metadata", None), "digest")


def _sha256_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def kernel_mapping(repository, devices=DEVICES) -> dict:
    """A kernels mapping that sends ``rotary_pos_emb`` to this layer in every mode (training,
    inference, each with or without torch.compile) on ``devices``, from the local repository at
    ``repository`` (see ``write_local_repository``). Registering it for a device replaces the
    mapping transformers ships for that device."""
    from kernels import LocalLayerRepository, Mode

    repo = LocalLayerRepository(repo_path=Path(repository), layer_name=LAYER_NAME)
    modes = (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE,
             Mode.INFERENCE | Mode.TORCH_COMPILE)
    return {"rotary_pos_emb": {device: {mode: repo for mode in modes} for device in devices}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m rope_ops.integrations.kernels_hub DIRECTORY", file=sys.stderr)
        return 2
    print(write_local_repository(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
