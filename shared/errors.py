"""Errors both sides raise, and the process exit codes they map to."""

EXIT_POLICY = 78  # EX_CONFIG: the operator's policy (e.g. --paged-attn on) cannot be honored
EXIT_FATAL = 1


class KvpactError(Exception):
    """Base class of every error kvpact raises on purpose. `rank`: the tensor-parallel rank it happened
    on, when a rank other than the worker's own process found it (worker/parallel/rank_verdict.py)."""

    rank: int | None = None


FEATURE_TITLES = {  # how a message names each feature, with its verb
    "paged-attn": "PagedAttention was",
    "prefix-caching": "Prefix caching was",
    "cpu-kernels": "The C CPU kernels were",
    "quant-kernels": "The quantized (Q4_1 / Q8_0) kernels were",
    "cuda-graphs": "CUDA graphs were",
}


class FeatureRequiredError(KvpactError):
    """`--FEATURE on` cannot be honored. `component` found it; `reason` says why; `code` names it."""

    def __init__(
        self, reason: str, component: str = "", *, feature: str = "paged-attn", code: str = ""
    ) -> None:
        self.reason = reason
        self.component = component
        self.feature = feature
        self.code = code
        where = f" [{component}]" if component else ""
        title = FEATURE_TITLES.get(feature, f"{feature} was")
        super().__init__(f"{title} explicitly requested (--{feature} on), but {reason}.{where}")


class PagedAttentionRequiredError(FeatureRequiredError):
    """`--paged-attn on` cannot be honored."""

    def __init__(self, reason: str, component: str = "", code: str = "") -> None:
        super().__init__(reason, component, feature="paged-attn", code=code)


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
