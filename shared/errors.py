"""Errors both sides raise, and the process exit codes they map to."""

EXIT_POLICY = 78  # EX_CONFIG: the operator's policy (e.g. --paged-attn on) cannot be honored
EXIT_FATAL = 1


class KvpactError(Exception):
    """Base class of every error kvpact raises on purpose."""


class PagedAttentionRequiredError(KvpactError):
    """`--paged-attn on` cannot be honored. `component` found it; `reason` says why."""

    def __init__(self, reason: str, component: str = "") -> None:
        self.reason = reason
        self.component = component
        where = f" [{component}]" if component else ""
        super().__init__(f"PagedAttention was explicitly requested (--paged-attn on), but {reason}.{where}")


class ConfigError(KvpactError):
    """Flags that contradict each other, the device or the model. The message names the flags."""


class BindError(KvpactError):
    """A port the process should listen on cannot be bound (exit 1: the flag is fine, the machine is not)."""

    def __init__(self, flag: str, address: str) -> None:
        super().__init__(
            f"{flag} {address}: cannot bind (the port is in use, or the host is not this machine's); "
            "stop what holds it or choose another port"
        )


class ModelLoadError(KvpactError):
    """A model file is missing, corrupt or of an unsupported architecture."""


class RequestError(KvpactError):
    """A request that can never be served as asked (maps to INVALID_ARGUMENT)."""
