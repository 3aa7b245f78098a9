"""The layers point down (docs/architecture.md): every import is read, function-local and TYPE_CHECKING ones
included, and an arrow that points up, an import cycle among fd_core's modules, or a private name taken
from another module fails.

contract (fd_core/*.py) <- host (fd_core/host/) <- runtime (fd_core/runtime/) <- testing (fd_core/testing/)
    <- serve (fd_core/serve/) <- cli (fd_core/cli/)

The package's front (fd_core/__init__.py) is the contract's, and may also name the host's Backend and
load_backend (loaded on first use). Inside the runtime, its groups point down too:
text <- engine <- ranks <- session.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FD_PACKAGES = ("fd_core", "fd_plugins", "fd_models", "fd_bench")
LAYERS = ("contract", "host", "runtime", "testing", "serve", "cli")
RUNTIME_GROUPS = ("text", "engine", "ranks", "session")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (a submodule when `from package import submodule` names one)
    names: tuple[str, ...]  # the names taken from it (empty for `import x`)
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(root: Path, packages: tuple[str, ...] = FD_PACKAGES) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(path, root)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    """Every import in the file (ast.walk reaches function bodies and `if TYPE_CHECKING:` blocks)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from fd_core.runtime import progress` imports the submodule
                    found.append(Import(name, sub, (), node.lineno))
                else:
                    found.append(Import(name, base, (alias.name,), node.lineno))
    return found


def layer_of(module: str) -> str | None:
    """fd_core's layer of a module; None outside fd_core."""
    parts = module.split(".")
    if parts[0] != "fd_core":
        return None
    if len(parts) > 1 and parts[1] in ("host", "runtime", "testing", "serve"):
        return parts[1]
    if len(parts) > 1 and parts[1] == "cli":
        return "cli"
    return "contract"


def runtime_group_of(module: str) -> str | None:
    """The runtime group of a module (text, engine, ranks, session); None for the runtime's other modules."""
    parts = module.split(".")
    if parts[:2] != ["fd_core", "runtime"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in RUNTIME_GROUPS else None


def upward_arrows(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src is None:
            continue
        if imp.target.split(".")[0] in FD_PACKAGES[1:]:
            bad.append(f"{imp.source}:{imp.line} imports {imp.target}: fd_core never imports plugins, models or benchmarks")
        elif imp.source == "fd_core" and dst == "host":
            continue  # the package's front names the host's Backend and load_backend
        elif dst is not None and LAYERS.index(dst) > LAYERS.index(src):
            bad.append(f"{imp.source}:{imp.line} ({src}) imports {imp.target} ({dst}): an arrow pointing up")
        else:
            have, want = runtime_group_of(imp.source), runtime_group_of(imp.target)
            if have is not None and want is not None and RUNTIME_GROUPS.index(want) > RUNTIME_GROUPS.index(have):
                bad.append(f"{imp.source}:{imp.line} (runtime {have}) imports {imp.target} (runtime {want}): an arrow pointing up")
    return bad


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself), by Tarjan."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.source.startswith("fd_core") and imp.target.startswith("fd_core"):
            graph.setdefault(imp.source, set()).add(imp.target)
            graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def private_reaches(imports: list[Import]) -> list[str]:
    """A private name (`_x`) imported from another fd module (a private module within its own package is fine)."""
    bad = []
    for imp in imports:
        if imp.target.split(".")[0] not in FD_PACKAGES or imp.target == imp.source:
            continue
        for name in imp.names:
            if name.startswith("_") and not name.startswith("__"):
                bad.append(f"{imp.source}:{imp.line} takes {imp.target}.{name}, a private name; make it public or keep it there")
    return bad


def private_attributes(modules: dict[str, Path]) -> list[str]:
    """`alias._x` where `alias` is an fd module this file imported: reaching into another module's privates."""
    bad = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in FD_PACKAGES and alias.asname:
                        aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FD_PACKAGES:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != name):
                bad.append(f"{name}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}, a private name")
    return bad


def check_tree(root: Path) -> list[str]:
    modules = modules_of(root)
    known = set(modules)
    imports = [imp for name, path in modules.items() for imp in imports_of(name, path, known)]
    problems = upward_arrows(imports) + private_reaches(imports) + private_attributes(modules)
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(imports)]
    return problems


def test_the_layers_point_down_without_cycles_or_private_reaches() -> None:
    problems = check_tree(ROOT)
    assert not problems, "\n".join(problems)


def test_every_fd_core_module_is_in_a_layer() -> None:
    layers = {layer_of(name) for name in modules_of(ROOT, ("fd_core",))}
    assert layers == set(LAYERS)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"fd_core/__init__.py": "", "fd_core/runtime/__init__.py": "", "fd_core/errors.py": "",
                      "fd_core/runtime/engine.py": "from fd_core.errors import x\n", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in FD_PACKAGES[1:]:
        (tmp_path / package).mkdir(exist_ok=True)
    return tmp_path


def test_the_check_passes_a_clean_tree(tmp_path: Path) -> None:
    assert check_tree(_tree(tmp_path, {})) == []


def test_the_check_fails_an_upward_import_even_inside_a_function(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"fd_core/models.py": "def f():\n    from fd_core.runtime.engine import Engine\n"})
    assert check_tree(tree) == ["fd_core.models:2 (contract) imports fd_core.runtime.engine (runtime): an arrow pointing up"]


def test_the_check_fails_a_submodule_imported_from_its_package(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"fd_core/models.py": "from fd_core.runtime import engine\n"})
    assert check_tree(tree) == ["fd_core.models:1 (contract) imports fd_core.runtime.engine (runtime): an arrow pointing up"]


def test_the_check_fails_a_cycle(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"fd_core/runtime/plan.py": "from fd_core.runtime.worker import W\n",
                            "fd_core/runtime/worker.py": "def f():\n    from fd_core.runtime.plan import P\n"})
    assert check_tree(tree) == ["import cycle: fd_core.runtime.plan -> fd_core.runtime.worker"]


def test_the_check_fails_a_private_name_taken_or_read(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"fd_core/runtime/plan.py": "from fd_core.runtime.engine import _pad\n",
                            "fd_core/runtime/worker.py": "from fd_core.runtime import engine\nengine._pad\n"})
    assert sorted(check_tree(tree)) == [
        "fd_core.runtime.plan:1 takes fd_core.runtime.engine._pad, a private name; make it public or keep it there",
        "fd_core.runtime.worker:2 reads fd_core.runtime.engine._pad, a private name",
    ]


def test_the_check_fails_the_runtime_importing_the_server(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"fd_core/serve/__init__.py": "",
                            "fd_core/serve/app.py": "from fd_core.runtime.engine import Engine\n",
                            "fd_core/runtime/plan.py": "def f():\n    from fd_core.serve.app import Server\n"})
    assert check_tree(tree) == ["fd_core.runtime.plan:2 (runtime) imports fd_core.serve.app (serve): an arrow pointing up"]


def test_the_check_fails_the_contract_importing_the_host(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"fd_core/host/__init__.py": "", "fd_core/host/backend.py": "",
                            "fd_core/models.py": "from fd_core.host.backend import Backend\n",
                            "fd_core/__init__.py": "def __getattr__(name):\n    from fd_core.host import backend\n"})
    assert check_tree(tree) == ["fd_core.models:1 (contract) imports fd_core.host.backend (host): an arrow pointing up"]


def test_the_check_fails_the_engine_importing_the_ranks(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"fd_core/runtime/engine/__init__.py": "", "fd_core/runtime/ranks/__init__.py": "",
                            "fd_core/runtime/engine/loop.py": "def f():\n    from fd_core.runtime.ranks.worker import RankWorker\n"})
    assert check_tree(tree) == [
        "fd_core.runtime.engine.loop:2 (runtime engine) imports fd_core.runtime.ranks.worker (runtime ranks): an arrow pointing up"
    ]


def test_the_check_fails_fd_core_importing_a_plugin(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"fd_core/runtime/plan.py": "import fd_plugins.cpu\n"})
    assert check_tree(tree) == ["fd_core.runtime.plan:1 imports fd_plugins.cpu: fd_core never imports plugins, models or benchmarks"]
