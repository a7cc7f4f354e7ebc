"""The cluster file `kvpact-launch --config FILE` reads: its schema, its validation, and the command lines
it implies. Pure: nothing here touches Ray, a socket or a process.

    ray:
      address: auto              # "auto" = the cluster this job runs in ($RAY_ADDRESS, else the local
                                 # head); "local" = start one on this machine; or a head's HOST:PORT
      placement_strategy: PACK   # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
      placement_timeout_s: 300   # resources never granted -> exit 1 naming what could not be placed
    router:
      listen: 0.0.0.0:50051
      paged_attn: on             # the cluster policy; also each worker's --paged-attn unless its flags say
      policies: {cuda-graphs: off, prefix-caching: on}   # router --policy NAME=MODE for every feature
      startup_timeout_s: 900
      auth_token_file: null      # read on the launcher's node; the same token reaches every worker
      flags: {}                  # any other router flag, by its CLI name without the dashes
    workers:                     # one or more groups; replicas get worker ids NAME-0, NAME-1, ...
      - name: gpu
        replicas: 2              # the starting size (all-or-nothing: one placement group for them all)
        min_replicas: 2          # the bounds of `kvpact-launch scale` (both default to replicas;
        max_replicas: 2          # 1 <= min_replicas <= replicas <= max_replicas); a worker added later
                                 # gets a one-bundle placement group of its own
        autoscale: null          # {metric: waiting | kv_usage, target: X, up_after_s: 30, down_after_s: 300}:
                                 # one worker more (fewer) when the group's mean load stays above (below)
                                 # X that long, within the bounds (deploy/autoscale.py)
        resources: {num_gpus: 1, num_cpus: 4}   # one placement-group bundle per replica; any Ray resource
                                 # (per worker: with flags tensor-parallel-size N, num_gpus is N, one
                                 # GPU per rank, all in the worker's bundle, so on one node)
        max_restarts: 0          # restarts of a replica that dies after the cluster serves, within any
                                 # 10 minutes (deploy/restarts.py: exponential backoff from 1 s)
        port_range: null         # [LOW, HIGH]: each worker listens on a free port of it (firewalls);
                                 # null = any free port
        flags: {paged-attn: on, model: /models/llama, pa-memory-fraction: 0.9}

Validation happens before Ray is touched: every error is one line naming the key (`workers[1].flags.model`)
and what is allowed, and `kvpact-launch` exits 2 with it. Worker and router `flags` are checked by the
CLIs' own argument parsers (kvpact.worker.cli, kvpact.router.cli), so the file and the CLIs cannot drift.
YAML 1.1 reads a bare `on`/`off` as a boolean: for `paged_attn`, `router.policies` and every feature flag
(`paged-attn`, `prefix-caching`, `cpu-kernels`, `cuda-graphs`), true means "on" and false means "off"; any
other flag given a boolean must be a switch (`log-prompts: true`), else the error says to quote the value.
`router.policies` may name paged-attn too, if `paged_attn` is absent or says the same.
Flags the launcher sets itself (the worker's --router,
--worker-id, --listen, --label; the router's --listen, --paged-attn, --expect-workers, --startup-timeout,
--auth-token-file) are refused in `flags`, with the key to use instead where there is one.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from kvpact.deploy.autoscale import METRICS, AutoscalePolicy
from kvpact.shared.address import join_host_port
from kvpact.shared.errors import ConfigError, KvpactError
from kvpact.shared.features import FEATURES
from kvpact.shared.intent import PagedAttentionMode

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
# Ray's built-in resources under the names ray.remote takes; any other key is a custom resource.
_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
# Flags the launcher sets on every worker / the router (flag -> what to set instead, "" = nothing).
LAUNCHER_WORKER_FLAGS = {
    "router": "",
    "worker-id": "the group's name (ids are NAME-0, NAME-1, ...)",
    "listen": "",
    "label": "",
    "auth-token-file": "router.auth_token_file",
    "help": "",
}
LAUNCHER_ROUTER_FLAGS = {
    "listen": "router.listen",
    "paged-attn": "router.paged_attn",
    "expect-workers": "the workers' replicas (their sum)",
    "startup-timeout": "router.startup_timeout_s",
    "auth-token-file": "router.auth_token_file",
    "report-file": "",
    "help": "",
}


class ClusterFileError(KvpactError):
    """The cluster file is not valid. The message is one line: FILE: KEY: what is wrong, what is allowed."""


@dataclass(frozen=True, slots=True)
class RaySection:
    address: str = "auto"
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class RouterSection:
    listen: str = "0.0.0.0:50051"
    paged_attn: PagedAttentionMode = PagedAttentionMode.AUTO
    startup_timeout_s: float = 900.0
    auth_token_file: str | None = None
    flags: tuple[str, ...] = ()  # argv of the other router flags, in file order
    drain_timeout_s: float = 30.0  # its --drain-timeout, as its parser read it
    policies: tuple[tuple[str, PagedAttentionMode], ...] = ()  # every other feature's --policy, file order


@dataclass(frozen=True, slots=True)
class WorkerGroup:
    name: str
    replicas: int
    resources: Mapping[str, float]  # as Ray names them: CPU, GPU, memory, custom ones
    flags: tuple[str, ...]  # argv from the group's flags (--paged-attn always present)
    max_restarts: int = 0
    port_range: tuple[int, int] | None = None
    drain_timeout_s: float = 30.0  # its --drain-timeout, as the worker's parser read it
    min_replicas: int = 0  # 0: replicas (the bounds `kvpact-launch scale` keeps to)
    max_replicas: int = 0
    autoscale: AutoscalePolicy | None = None
    tensor_parallel_size: int = 1  # its flags' --tensor-parallel-size: ranks per worker, in its one bundle

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_replicas", self.min_replicas or self.replicas)
        object.__setattr__(self, "max_replicas", self.max_replicas or self.replicas)

    def worker_ids(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.replicas)]

    def bounds_error(self, num: int) -> str:
        """Why `num` replicas is outside this group's bounds, or ""."""
        if self.min_replicas <= num <= self.max_replicas:
            return ""
        return (
            f"group {self.name!r}: {num} replicas is outside its bounds [{self.min_replicas}, "
            f"{self.max_replicas}] (workers[].min_replicas, workers[].max_replicas in the cluster file)"
        )


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """One worker of the cluster: its id, its group, and its placement-group bundle."""

    worker_id: str
    group: WorkerGroup
    bundle_index: int


@dataclass(frozen=True, slots=True)
class ClusterFile:
    path: str
    ray: RaySection
    router: RouterSection
    workers: tuple[WorkerGroup, ...] = field(default_factory=tuple)

    @property
    def num_workers(self) -> int:
        """The router's --expect-workers: the sum of the replicas."""
        return sum(g.replicas for g in self.workers)

    def slots(self) -> list[WorkerSlot]:
        """Every worker in bundle order (group by group, replica by replica)."""
        slots: list[WorkerSlot] = []
        for group in self.workers:
            for worker_id in group.worker_ids():
                slots.append(WorkerSlot(worker_id, group, len(slots)))
        return slots

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles, one per worker, in slot order."""
        return [dict(slot.group.resources) for slot in self.slots()]

    def router_argv(self, listen: str | None = None) -> list[str]:
        """The router's flags (without the program): the file's, or `listen` in place of router.listen."""
        r = self.router
        argv = ["--listen", listen or r.listen, "--paged-attn", r.paged_attn.value]
        for name, mode in r.policies:
            argv += ["--policy", f"{name}={mode.value}"]
        argv += ["--expect-workers", str(self.num_workers), "--startup-timeout", _number(r.startup_timeout_s)]
        if r.auth_token_file:
            argv += ["--auth-token-file", r.auth_token_file]
        return argv + list(r.flags)


def worker_argv(
    slot: WorkerSlot,
    *,
    router: str,
    host: str,
    labels: Mapping[str, str] | None = None,
    auth_token_file: str | None = None,
    port: int = 0,
) -> list[str]:
    """A worker's flags (without the program): the group's, then what the launcher decides: its id, the
    router, `port` on `host` (0: a free one), `host` as the advertised address unless the group sets
    advertise-host, Prometheus metrics on a free port of `host` unless the group sets metrics-port (the
    worker reports the address it bound, so ClusterStatus tells a scraper where each worker's
    /metrics is), its bundle's CPUs as its torch threads unless the group sets threads (at least 1:
    a fractional num_cpus still runs), and its labels."""
    argv = list(slot.group.flags)
    if "--threads" not in argv:
        argv += ["--threads", str(max(1, int(slot.group.resources.get("CPU", 1))))]
    argv += ["--worker-id", slot.worker_id, "--router", router, "--listen", join_host_port(host, port)]
    if "--advertise-host" not in argv:
        argv += ["--advertise-host", host]
    if "--metrics-port" not in argv:
        argv += ["--metrics-port", "0"]
    for key, value in (labels or {}).items():
        argv += ["--label", f"{key}={value}"]
    if auth_token_file:
        argv += ["--auth-token-file", auth_token_file]
    return argv


def _number(value: float) -> str:
    return f"{value:g}" if value != int(value) else str(int(value))


# ----------------------------------------------------------------------------------------------- loading


def load_cluster_file(path: str | Path) -> ClusterFile:
    """Read and validate the cluster file; ClusterFileError (one line) on anything wrong."""
    # The ray extra's; imported here, so the schema's users need it only to read a file.
    import yaml  # type: ignore[import-untyped]

    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ClusterFileError(
            f"{where}: cannot read it ({exc.strerror or exc}); pass --config FILE"
        ) from None
    try:
        document = yaml.load(text, Loader=_unique_key_loader(yaml))  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ClusterFileError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    return parse_cluster_file(document, where)


def _unique_key_loader(yaml: Any) -> type:
    """yaml.SafeLoader that refuses a key given twice (PyYAML would keep the last one silently)."""

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} appears twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def parse_cluster_file(document: object, where: str = "<cluster file>") -> ClusterFile:
    """Validate an already-parsed document (a dict as YAML gives it)."""
    top = _mapping(document, where, "the file", {"ray", "router", "workers"}, required={"workers"})
    ray_section = _ray(_mapping(top.get("ray", {}), where, "ray", set(RaySection.__slots__)), where)
    router = _router(_mapping(top.get("router", {}), where, "router", set(RouterSection.__slots__)), where)
    groups = top["workers"]
    if not isinstance(groups, list) or not groups:
        _fail(where, "workers", "expected a list of one or more worker groups", groups)
    workers = tuple(_group(g, where, f"workers[{i}]", router.paged_attn) for i, g in enumerate(groups))
    names = [g.name for g in workers]
    for i, name in enumerate(names):
        if name in names[:i]:
            _fail(where, f"workers[{i}].name", "expected a name no other group has", name)
    _check_port_ranges(workers, where)
    cluster = ClusterFile(where, ray_section, router, workers)
    args = _check_router_flags(cluster, where)
    cluster = replace(cluster, router=replace(router, drain_timeout_s=args.drain_timeout_s))
    for i, group in enumerate(workers):
        if group.drain_timeout_s > cluster.router.drain_timeout_s:
            _fail(
                where,
                f"workers[{i}].flags.drain-timeout",
                f"expected at most the router's --drain-timeout ({cluster.router.drain_timeout_s:g} s): the "
                "router relays the streams a stopping worker finishes, and would cut them off first; raise "
                "router.flags.drain-timeout or lower this one",
                group.drain_timeout_s,
            )
    return cluster


def _ray(section: dict[str, Any], where: str) -> RaySection:
    address = section.get("address", "auto")
    if not isinstance(address, str) or not address:
        _fail(where, "ray.address", 'expected "auto", "local" or a head\'s HOST:PORT', address)
    strategy = section.get("placement_strategy", "PACK")
    if strategy not in PLACEMENT_STRATEGIES:
        _fail(where, "ray.placement_strategy", f"expected one of {', '.join(PLACEMENT_STRATEGIES)}", strategy)
    timeout = _seconds(section.get("placement_timeout_s", 300), where, "ray.placement_timeout_s")
    return RaySection(address, strategy, timeout)


def _router(section: dict[str, Any], where: str) -> RouterSection:
    listen = section.get("listen", "0.0.0.0:50051")
    if not isinstance(listen, str):
        _fail(where, "router.listen", "expected HOST:PORT (port 0 = a free port)", listen)
    policy = _mode(section.get("paged_attn", "auto"), where, "router.paged_attn")
    policies = _policies(section.get("policies", {}), where)
    if "paged-attn" in policies:
        if "paged_attn" in section and policies["paged-attn"] is not policy:
            _fail(
                where,
                "router.policies.paged-attn",
                f"expected the same mode as router.paged_attn ({policy.value}), or only one of the two",
                policies["paged-attn"].value,
            )
        policy = policies.pop("paged-attn")
    timeout = _seconds(section.get("startup_timeout_s", 900), where, "router.startup_timeout_s")
    token_file = section.get("auth_token_file")
    if token_file is not None and (not isinstance(token_file, str) or not token_file):
        _fail(where, "router.auth_token_file", "expected a file path or null", token_file)
    from kvpact.router.cli import build_parser

    flags = _flags_argv(
        section.get("flags", {}), where, "router.flags", build_parser(), LAUNCHER_ROUTER_FLAGS
    )
    return RouterSection(listen, policy, timeout, token_file, tuple(flags), policies=tuple(policies.items()))


def _policies(raw: object, where: str) -> dict[str, PagedAttentionMode]:
    """`router.policies: {NAME: MODE}`: each a feature of shared/features.py; a YAML boolean is on/off."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        _fail(where, "router.policies", "expected a mapping of feature names to auto, on or off", raw)
    for name in raw:
        if name not in FEATURES:
            _fail(where, f"router.policies.{name}", f"expected a feature name: {', '.join(FEATURES)}", name)
    return {name: _mode(mode, where, f"router.policies.{name}") for name, mode in raw.items()}


def _group(raw: object, where: str, key: str, policy: PagedAttentionMode) -> WorkerGroup:
    allowed = {"name", "replicas", "min_replicas", "max_replicas", "resources", "flags", "max_restarts"}
    allowed |= {"port_range", "autoscale"}
    group = _mapping(raw, where, key, allowed, required={"name", "replicas"})
    name = group["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        _fail(where, f"{key}.name", "expected lowercase letters, digits and '-' (at most 40)", name)
    replicas = _whole(group["replicas"], where, f"{key}.replicas", minimum=1)
    min_replicas = _whole(group.get("min_replicas", replicas), where, f"{key}.min_replicas", minimum=1)
    if min_replicas > replicas:
        _fail(where, f"{key}.min_replicas", f"expected at most replicas ({replicas})", min_replicas)
    max_replicas = _whole(group.get("max_replicas", replicas), where, f"{key}.max_replicas", minimum=1)
    if max_replicas < replicas:
        _fail(where, f"{key}.max_replicas", f"expected at least replicas ({replicas})", max_replicas)
    max_restarts = _whole(group.get("max_restarts", 0), where, f"{key}.max_restarts", minimum=0)
    resources = _resources(group.get("resources", {"num_cpus": 1}), where, f"{key}.resources")
    port_range = _port_range(group.get("port_range"), max_replicas, where, f"{key}.port_range")
    autoscale = _autoscale(group.get("autoscale"), min_replicas, max_replicas, where, f"{key}.autoscale")
    from kvpact.worker.cli import build_parser

    parser = build_parser()
    flags = _flags_argv(group.get("flags", {}), where, f"{key}.flags", parser, LAUNCHER_WORKER_FLAGS)
    if "--paged-attn" not in flags:
        flags = ["--paged-attn", policy.value, *flags]
    worker = WorkerGroup(
        name, replicas, resources, tuple(flags), max_restarts, port_range,
        min_replicas=min_replicas, max_replicas=max_replicas, autoscale=autoscale,
    )  # fmt: skip
    slot = WorkerSlot(f"{name}-0", worker, 0)
    argv = worker_argv(slot, router="127.0.0.1:1", host="127.0.0.1")
    args = _check_with(parser, argv, where, f"{key}.flags")
    size = args.tensor_parallel_size
    gpus = resources.get("GPU", 0)
    if size > 1 and gpus and gpus != size:  # a bundle is one node's: all of a worker's ranks are there
        _fail(
            where,
            f"{key}.resources.num_gpus",
            f"expected {size}: a group's resources are per worker, and each of the {size} ranks of "
            f"--tensor-parallel-size {size} takes one GPU (or no num_gpus: ranks on CPU)",
            gpus,
        )
    return replace(worker, drain_timeout_s=args.drain_timeout_s, tensor_parallel_size=size)


def _autoscale(raw: object, low: int, high: int, where: str, key: str) -> AutoscalePolicy | None:
    """{metric, target, up_after_s, down_after_s}, for a group whose bounds leave room to move."""
    if raw is None:
        return None
    section = _mapping(
        raw, where, key, {"metric", "target", "up_after_s", "down_after_s"}, {"metric", "target"}
    )
    metric = section["metric"]
    if metric not in METRICS:
        _fail(where, f"{key}.metric", f"expected one of {', '.join(METRICS)}", metric)
    target = section["target"]
    top = 1.0 if metric == "kv_usage" else math.inf
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target < top:
        what = "a fraction between 0 and 1 (exclusive)" if metric == "kv_usage" else "a number > 0"
        _fail(where, f"{key}.target", f"expected {what} for metric {metric}", target)
    if low == high:
        _fail(
            where,
            key,
            f"expected min_replicas < max_replicas (both {low}): autoscaling needs room to add or remove",
            raw,
        )
    up = _seconds(section.get("up_after_s", 30), where, f"{key}.up_after_s")
    down = _seconds(section.get("down_after_s", 300), where, f"{key}.down_after_s")
    return AutoscalePolicy(metric, float(target), up, down)


def _port_range(raw: object, replicas: int, where: str, key: str) -> tuple[int, int] | None:
    """[LOW, HIGH], 1024 <= LOW <= HIGH <= 65535, with a port for each of up to `replicas` workers (its
    max_replicas: all may share a node)."""
    if raw is None:
        return None
    ports = raw if isinstance(raw, list) and len(raw) == 2 and all(type(p) is int for p in raw) else None
    if ports is None or not 1024 <= ports[0] <= ports[1] <= 65535:
        _fail(where, key, "expected [LOW, HIGH], whole numbers with 1024 <= LOW <= HIGH <= 65535", raw)
    low: int = ports[0]
    high: int = ports[1]
    if high - low + 1 < replicas:
        _fail(
            where,
            key,
            f"expected at least {replicas} ports (max_replicas: {replicas}, who may all share one node); "
            "widen the range",
            raw,
        )
    return low, high


def _check_port_ranges(groups: Sequence[WorkerGroup], where: str) -> None:
    """No two groups' port ranges overlap (their workers on one node would reach for the same ports)."""
    ranged: list[tuple[int, tuple[int, int]]] = [
        (i, g.port_range) for i, g in enumerate(groups) if g.port_range is not None
    ]
    for n, (i, (low, high)) in enumerate(ranged):
        for j, (other_low, other_high) in ranged[:n]:
            if low <= other_high and other_low <= high:
                _fail(
                    where,
                    f"workers[{i}].port_range",
                    f"expected a range that does not overlap workers[{j}].port_range "
                    f"[{other_low}, {other_high}]",
                    [low, high],
                )


def _resources(raw: object, where: str, key: str) -> dict[str, float]:
    if not isinstance(raw, dict) or not raw:
        _fail(where, key, "expected a mapping of Ray resources, e.g. {num_gpus: 1, num_cpus: 4}", raw)
    resources = {}
    for name, amount in raw.items():
        if not isinstance(name, str) or name in ("CPU", "GPU"):
            _fail(
                where, f"{key}.{name}", "expected num_cpus, num_gpus, memory or a custom resource name", name
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount >= 0:
            _fail(where, f"{key}.{name}", "expected a number >= 0", amount)
        resources[_RESOURCE_NAMES.get(name, name)] = amount
    if not any(resources.values()):
        _fail(where, key, "expected at least one resource > 0 (Ray cannot place an empty bundle)", raw)
    return {name: amount for name, amount in resources.items() if amount}


def _flags_argv(
    raw: object, where: str, key: str, parser: argparse.ArgumentParser, reserved: Mapping[str, str]
) -> list[str]:
    """`{name: value}` -> ["--name", "value", ...]; a switch is given `true` (or `false` to leave it off)."""
    if raw is None:
        return []
    if not isinstance(raw, dict):
        _fail(where, key, "expected a mapping of flag names (without the dashes) to values", raw)
    switches = {
        option
        for action in parser._actions  # argparse has no public way to ask which options take no value
        if action.nargs == 0
        for option in action.option_strings
    }
    argv: list[str] = []
    for name, value in raw.items():
        here = f"{key}.{name}"
        if not isinstance(name, str) or name.startswith("-"):
            _fail(where, here, "expected a flag name without the leading dashes, e.g. pa-backend", name)
        if name in reserved:
            instead = f"; set {reserved[name]} instead" if reserved[name] else ""
            _fail(where, here, f"--{name} is set by kvpact-launch{instead}", value)
        option = f"--{name}"
        if option in switches:
            if not isinstance(value, bool):
                _fail(where, here, f"{option} is a switch: expected true or false", value)
            argv += [option] if value else []
            continue
        for item in value if isinstance(value, list) else [value]:
            argv += [option, _flag_value(item, where, here, paged=name in FEATURES)]
    return argv


def _flag_value(value: object, where: str, key: str, *, paged: bool) -> str:
    if paged:
        return _mode(value, where, key).value
    if isinstance(value, bool):
        _fail(where, key, "YAML read a boolean (yes/no/on/off/true/false); quote the value", value)
    if isinstance(value, int | float | str) and not (isinstance(value, float) and not math.isfinite(value)):
        return value if isinstance(value, str) else _number(value)
    _fail(where, key, "expected a string or a number", value)


def _check_router_flags(cluster: ClusterFile, where: str) -> argparse.Namespace:
    """The router's whole command line through its parser (the token file is read by the launcher)."""
    from kvpact.router.cli import build_parser

    return _check_with(build_parser(), cluster.router_argv(), where, "router")


def _check_with(
    parser: argparse.ArgumentParser, argv: Sequence[str], where: str, key: str
) -> argparse.Namespace:
    """Parse `argv` with the CLI's own parser; its complaint becomes a ClusterFileError for `key`. For
    the worker, its spec is built too (a --pa-* value the intent core rejects is caught here)."""

    def error(message: str) -> NoReturn:
        raise ClusterFileError(f"{where}: {key}: {message} (flags checked by the {parser.prog} CLI)")

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(list(argv))
    if parser.prog == "worker":
        from kvpact.worker.cli import refuse_unused_paged_flags, spec_from_args

        try:
            refuse_unused_paged_flags(args, argv)
            spec_from_args(args)
        except ConfigError as exc:
            error(str(exc))
    return args


# ------------------------------------------------------------------------------------------------ values


def _mapping(
    raw: object, where: str, key: str, allowed: set[str], required: frozenset[str] | set[str] = frozenset()
) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        _fail(where, key, "expected a mapping", raw)
    for name in raw:
        if name not in allowed:
            path = name if key == "the file" else f"{key}.{name}"
            _fail(where, str(path), f"unknown key; allowed here: {', '.join(sorted(allowed))}", raw[name])
    for name in sorted(required - raw.keys()):
        _fail(where, name if key == "the file" else f"{key}.{name}", "required", None)
    return raw


def _mode(value: object, where: str, key: str) -> PagedAttentionMode:
    if value is True:
        return PagedAttentionMode.ON
    if value is False:
        return PagedAttentionMode.OFF
    try:
        return PagedAttentionMode(value)
    except ValueError:
        _fail(where, key, "expected auto, on or off", value)


def _whole(value: object, where: str, key: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(where, key, f"expected a whole number >= {minimum}", value)
    return value


def _seconds(value: object, where: str, key: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        _fail(where, key, "expected a number of seconds > 0", value)
    return float(value)


def _fail(where: str, key: str, allowed: str, value: object) -> NoReturn:
    got = "" if value is None and allowed == "required" else f", got {value!r}"
    raise ClusterFileError(f"{where}: {key}: {allowed}{got}")
