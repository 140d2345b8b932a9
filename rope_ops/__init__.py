"""rope_ops: Rotary Position Embedding for PyTorch, one op spec, pluggable backends.

    q_out, k_out = rope_ops.apply(q, k, pos)

See SPEC.md for the contract, ``python -m rope_ops info`` for the backends on this machine.
"""

from ._api import apply, apply_grad, positions_from_seqlens, seq_len_of
from ._errors import BackendError, RopeError
from ._select import ENV_VAR, use_backend
from .embedding import RotaryEmbedding
from .prologue import qkv_prologue

__version__ = "0.2.0.dev0"

__all__ = [
    "apply", "apply_grad", "qkv_prologue", "RotaryEmbedding", "RopeError", "BackendError", "use_backend",
    "positions_from_seqlens", "seq_len_of", "backend_names", "select_backend", "ENV_VAR",
]


def backend_names() -> list[str]:
    """Names of all registered backends (entry points), importing none of them."""
    from . import registry

    return registry.names()


def select_backend(q, k, pos, **kwargs) -> str:
    """The name of the backend that ``apply(q, k, pos, **kwargs)`` would run."""
    from . import _api

    return _api.which_backend(q, k, pos, **kwargs)


from . import distributed as _distributed  # noqa: E402,F401  (registers the ops' DTensor sharding rules)
