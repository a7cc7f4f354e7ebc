"""Guards on the shape of the code: the single fallback door and the one-way dependencies (docs/design.md,
"The contract" and "Layers").

Both read the source with `ast`, so they hold for code paths no test executes.
"""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "worker", "kernels", "shared", "deploy")
DOOR = ROOT / "shared" / "features.py"  # Ledger.fall_back, every feature's one door (paged-attn's too)
# Building an intent from the wire for mode OFF legitimately has no paged config.
MAY_BUILD_OFF_INTENT = {ROOT / "shared" / "handshake_pb.py"}
# Constructors whose paged config can also be given positionally: its index.
PAGED_POSITION = {"CacheIntent": 1}
LEDGER = {"findings", "modes"}  # a ledger's state: only its door changes it
MUTATORS = {"update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"}


def sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def fallback_violations(path: Path, tree: ast.AST) -> list[str]:
    """Places that clear or replace a paged config, or touch a ledger's findings, other than the door."""
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == "paged_config":
                found.append(f"{path.name}:{node.lineno} assigns .paged_config")
            inner = target.value if isinstance(target, ast.Subscript) else target
            if isinstance(inner, ast.Attribute) and inner.attr in LEDGER:
                found.append(f"{path.name}:{node.lineno} writes a ledger's {inner.attr}")
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            owner = getattr(node.func, "value", None)
            if name in MUTATORS and isinstance(owner, ast.Attribute) and owner.attr in LEDGER:
                found.append(f"{path.name}:{node.lineno} changes a ledger's {owner.attr}")
            if name in {"setattr", "__setattr__"} and any(
                isinstance(a, ast.Constant) and a.value in {"paged_config", "paged"} for a in node.args
            ):
                found.append(f"{path.name}:{node.lineno} setattr of the paged config")
            for kw in node.keywords:
                clears = isinstance(kw.value, ast.Constant) and kw.value.value is None
                if kw.arg in {"paged_config", "paged"} and clears and path not in MAY_BUILD_OFF_INTENT:
                    found.append(f"{path.name}:{node.lineno} builds an intent/state with {kw.arg}=None")
            index = PAGED_POSITION.get(name)
            if index is not None and len(node.args) > index and path not in MAY_BUILD_OFF_INTENT:
                arg = node.args[index]
                if isinstance(arg, ast.Constant) and arg.value is None:
                    found.append(f"{path.name}:{node.lineno} builds {name} with a None paged config")
    return found


def test_every_fallback_goes_through_the_ledgers_door():
    violations = []
    for path in sources(*PACKAGES):
        if path != DOOR:
            violations += fallback_violations(path, ast.parse(path.read_text(), str(path)))
    assert not violations, "call Ledger.fall_back (shared/features.py) instead:\n" + "\n".join(violations)


@pytest.mark.parametrize(
    "code",
    [
        "state.paged_config = None",
        "setattr(state, 'paged_config', None)",
        "replace(intent, paged=None)",
        "p.ledger.findings['paged-attn'] = finding",
        "p.ledger.findings.pop('paged-attn')",
        "del ledger.findings['cpu-kernels']",
        "ledger.modes['paged-attn'] = FeatureMode.ON",
        "CacheIntent(PagedAttentionMode.OFF, None)",
    ],
)
def test_guard_catches_a_planted_bypass(code):
    assert fallback_violations(ROOT / "worker" / "planted.py", ast.parse(code))


FORBIDDEN_IMPORTS = {
    "router": {"kvpact.worker", "kvpact.kernels", "torch", "triton"},
    "worker": {"kvpact.router"},
    "shared": {"kvpact.router", "kvpact.worker", "kvpact.kernels", "kvpact.deploy", "torch", "triton"},
    "kernels": {"kvpact.router", "kvpact.worker", "kvpact.shared", "kvpact.deploy"},
}


def _imported_names(tree: ast.AST) -> set[str]:
    """Every dotted name a module imports: `kvpact.shared.wire` and `kvpact.shared.wire.x` for
    `from kvpact.shared.wire import x`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def imported_roots(tree: ast.AST) -> set[str]:
    """What a module imports, by root: `torch` for `torch.nn`, `kvpact.worker` for `kvpact.worker.x`."""
    names = _imported_names(tree)
    return {".".join(n.split(".")[:2]) if n.startswith("kvpact.") else n.split(".")[0] for n in names}


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_dependencies_run_one_way(package):
    bad = []
    for path in sources(package):
        hits = imported_roots(ast.parse(path.read_text(), str(path))) & FORBIDDEN_IMPORTS[package]
        bad += [f"{path.relative_to(ROOT)} imports {', '.join(sorted(hits))}" for _ in [0] if hits]
    assert not bad, "\n".join(bad)


def test_client_library_does_not_import_torch_or_the_worker():
    forbidden = {"torch", "kvpact.worker", "kvpact.kernels", "kvpact.router", "kvpact.deploy"}
    bad = [
        f"{path.relative_to(ROOT)} imports {', '.join(sorted(hits))}"
        for path in sources("shared/client")
        if (hits := imported_roots(ast.parse(path.read_text(), str(path))) & forbidden)
    ]
    assert sources("shared/client") and not bad, bad


def test_the_client_is_imported_as_kvpact_client_only():
    """shared/client is mapped to `kvpact.client` (pyproject's package-dir); reaching the same files as
    `kvpact.shared.client` would load them twice, as two different modules."""
    paths = sources(*PACKAGES, "tests", "benchmarks", "tools") + sorted((ROOT / "protos").rglob("*.py"))
    bad = [
        str(path.relative_to(ROOT))
        for path in paths
        if any(
            n == "kvpact.shared.client" or n.startswith("kvpact.shared.client.")
            for n in _imported_names(ast.parse(path.read_text(), str(path)))
        )
    ]
    assert not bad, bad


TOP_LEVEL_PARTS = {"router", "worker", "shared", "kernels", "deploy"}


def test_every_part_is_imported_as_kvpact_dot_part():
    """One namespace: `router`, `shared`, ... as top-level names would collide in site-packages."""
    paths = sources(*PACKAGES, "tests", "benchmarks") + sorted((ROOT / "protos").rglob("*.py"))
    bad = []
    for path in paths:
        hits = imported_roots(ast.parse(path.read_text(), str(path))) & TOP_LEVEL_PARTS
        bad += [f"{path.relative_to(ROOT)} imports {', '.join(sorted(hits))}" for _ in [0] if hits]
    assert not bad, "import them as kvpact.<part>:\n" + "\n".join(bad)


def test_benchmarks_do_not_import_from_tests():
    """What benchmarks and tests share lives in the package (kvpact.worker.tokenizer.tiny)."""
    bad = [
        str(path.relative_to(ROOT))
        for path in sources("benchmarks")
        if "tests" in imported_roots(ast.parse(path.read_text(), str(path)))
    ]
    assert not bad, bad


def module_files() -> dict[str, Path]:
    """Every module of the `kvpact` namespace, by its import name (pyproject's package-dir mapping; a
    folder belongs to the deepest mapping that holds it)."""
    dirs = {
        name: ROOT / folder
        for name, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-dir"
        ].items()
    }
    found = {}
    for name, folder in dirs.items():
        for path in folder.rglob("*.py"):
            holders = [f for f in dirs.values() if path.is_relative_to(f)]
            if max(holders, key=lambda f: len(f.parts)) != folder:
                continue  # a nested mapping's file (shared/client/x.py is kvpact.client.x)
            parts = path.relative_to(folder).with_suffix("").parts
            found[".".join((name, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_back():
    """No import loop, counting the imports inside functions and under TYPE_CHECKING too (each is a
    dependency the reader must hold in mind): data modules are imported by their renderers, never the
    reverse (shared/realized.py holds data; shared/describe.py shows it)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from package import submodule` depends on the submodule, not on the package's __init__.
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & files.keys()
                deps |= subs or {node.module}
        graph[module] = (deps & files.keys()) - {module}
    assert "kvpact.shared.realized" in graph and "kvpact.client" in graph
    assert not import_cycles(graph)


def test_the_cycle_finder_finds_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


# The worker's rooms (docs/design.md, "Where each concept lives"): the process lifecycle at the top
# level uses startup/ and the engine core; startup/ builds the engine core; the engine core uses neither.
WORKER_LIFECYCLE = tuple(
    f"kvpact.worker.{m}"
    for m in ("cli", "process", "service", "registration", "metrics", "generate_pb", "options")
)
WORKER_CORE = ("engine", "kv", "model", "scheduler", "tokenizer", "loader", "parallel")
WORKER_ROOM_FORBIDS = {
    **{room: ("kvpact.worker.startup", *WORKER_LIFECYCLE) for room in WORKER_CORE},
    "startup": WORKER_LIFECYCLE,
}


def room_violations(room: str, tree: ast.AST) -> list[str]:
    forbidden = WORKER_ROOM_FORBIDS[room]
    return sorted(
        name
        for name in _imported_names(tree)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


def test_the_worker_rooms_import_one_way():
    bad = []
    for room in WORKER_ROOM_FORBIDS:
        for path in sources(f"worker/{room}"):
            hits = room_violations(room, ast.parse(path.read_text(), str(path)))
            bad += [f"{path.relative_to(ROOT)} imports {', '.join(hits)}" for _ in [0] if hits]
    assert sources("worker/engine") and sources("worker/startup") and not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("room", "code"),
    [
        ("engine", "from kvpact.worker.startup.device import probe_device"),
        ("scheduler", "import kvpact.worker.startup.engine_setup"),
        ("kv", "from kvpact.worker.metrics import WorkerMetrics"),
        ("startup", "from kvpact.worker.process import WorkerProcess"),
    ],
)
def test_the_room_guard_catches_a_planted_import(room, code):
    assert room_violations(room, ast.parse(code))
