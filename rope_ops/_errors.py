"""The two error types of rope_ops."""


class RopeError(ValueError):
    """An invalid call: bad argument, shape, dtype, device or layout.

    Raised before any kernel runs; nothing has been written to any input.
    """


class BackendError(RuntimeError):
    """No backend can run a call, a requested backend is unknown or unavailable, or a backend
    misbehaved (a third-party backend's outputs failed rope_ops' check).

    For a refusal the message lists every backend considered and why each refused, and
    ``refusals`` maps each name to its reasons; it is None for other failures.
    """

    def __init__(self, message: str, refusals: dict[str, list[str]] | None = None):
        super().__init__(message)
        self.refusals = refusals
