"""The two error types of rope_ops."""


class RopeError(ValueError):
    """An invalid call: bad argument, shape, dtype, device or layout.

    Raised before any kernel runs; nothing has been written to any input.
    """


class BackendError(RuntimeError):
    """No backend can run a call, or a requested backend is unknown or unavailable.

    The message lists every backend considered and why each refused.
    """
