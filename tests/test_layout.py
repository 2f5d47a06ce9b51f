"""Meta-tests of the layout: built-in plugins live in one folder per kind and register only that
kind, every plugin module has an entry point, core/ imports no plugin folder, and every hook is
documented in hookspecs.py and in docs/architecture.md."""

import ast
import functools
import importlib
import importlib.metadata
import inspect
import re
import sys
import tomllib
from pathlib import Path

import plait
import pluggy
import pytest
from plait import hookspecs

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"plugins": "plait.plugins", "losses": "plait.losses", "rewards": "plait.rewards"}
FORBIDDEN = tuple(FOLDERS.values())
REINSTALL = f"cd {ROOT} && {Path(sys.executable).parent}/pip install -q -e . --no-deps"

# Each folder of plugin modules and the kind-owning hooks (registration and dispatch) its modules
# may implement; lifecycle hooks (broadcast, e.g. trainer_callbacks) are open to every module.
# A new kind (judges, environments, callbacks) gets its own folder here.
KIND_FOLDERS = {
    "plugins/methods": {"register_methods"},
    "plugins/data/formats": {"register_data_formats", "detect_data_format"},
    "plugins/data/collators": {"register_collators"},
    "plugins/data/packing": {"register_packing_strategies"},
    "plugins/advantages": {"register_advantage_estimators"},
    "plugins/generation": {"register_generation_backends", "register_commands"},  # backends, `plait vllm-serve`
    "plugins/reward_sources": {"resolve_reward"},
    "plugins/commands": {"register_commands"},  # subcommands of their own (`plait reward`, TRL's names)
    "plugins/callbacks": set(),  # lifecycle only: TrainerCallbacks for every run (metrics.jsonl)
    "plugins/judges": {"register_judges"},  # online DPO's judges (reward_model, rules, pairwise)
    "plugins/environments": {"register_environments"},  # multi-turn environments, tools, tool-call formats
    "plugins/rollout_filters": {"register_rollout_filters"},  # dynamic sampling: zero_variance, accuracy_band, ...
    "plugins/chat_templates": {"register_chat_templates"},  # training chat templates by model family (qwen3, ...)
    "losses": {"register_losses"},
    "rewards": {"register_rewards"},
}
LIFECYCLE = {name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
             if hasattr(fn, "plait_spec") and not name.startswith("register_") and not fn.plait_spec["firstresult"]}


def installed_entry_points():
    return sorted(importlib.metadata.distribution("plait").entry_points.select(group="plait"), key=lambda ep: ep.name)


def module_name(path: Path) -> str:
    """``plugins/data/formats/sharegpt.py`` -> ``plait.plugins.data.formats.sharegpt``."""
    top, *rest = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((FOLDERS[top], *rest))


def plugin_files() -> list[Path]:
    """Every plugin module: the public .py files of the kind folders (private helpers start with _)."""
    return sorted(path for folder in KIND_FOLDERS for path in (ROOT / folder).glob("*.py")
                  if not path.name.startswith("_"))


def plugin_modules() -> list[str]:
    return [module_name(path) for path in plugin_files()]


def test_the_installed_plait_is_this_checkout():
    assert Path(plait.__file__).resolve().parent == ROOT / "core", (
        f"plait is imported from {plait.__file__}, not this checkout; install it with: {REINSTALL}")


def test_every_plugin_module_is_reached_through_an_entry_point():
    reached = {ep.module for ep in installed_entry_points()}
    missing = [module for module in plugin_modules() if module not in reached]
    assert not missing, (
        f"plugin modules without an entry point: {missing}; add one line per module under "
        f"[project.entry-points.plait] in pyproject.toml (e.g. name = \"{missing[0]}\"), then: {REINSTALL}")


def test_installed_entry_points_match_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["plait"]
    installed = {ep.name: ep.value for ep in installed_entry_points()}
    assert installed == declared, f"the installed metadata is stale; reinstall: {REINSTALL}"


def test_every_plugin_file_is_in_a_kind_folder():
    # a module outside the table (plugins/foo.py, plugins/judges/x.py) would be no kind's and untested
    strays = sorted(str(path.relative_to(ROOT)) for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")
                    if "__pycache__" not in path.parts and not path.name.startswith("_")  # helpers may be shared
                    and str(path.parent.relative_to(ROOT)) not in KIND_FOLDERS)
    assert not strays, (f"plugin modules outside a kind folder: {strays}; move each into the folder of its kind "
                        f"({', '.join(KIND_FOLDERS)}) or add a folder for a new kind to KIND_FOLDERS in {__file__}")


def test_every_plugin_package_is_packaged():
    # a folder setuptools does not list would be missing from a built wheel, though the editable install works
    packaged = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module_name(init.parent / "x.py").rpartition(".")[0]
                for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    missing = sorted(packages - packaged)
    assert not missing, f"packages absent from [tool.setuptools] packages in pyproject.toml: {missing}"


@pytest.mark.parametrize("path", plugin_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_plugin_module_registers_only_its_folders_kind(path):
    pm = pluggy.PluginManager("plait")
    pm.add_hookspecs(hookspecs)
    pm.register(importlib.import_module(module_name(path)))
    hooks = {caller.name for caller in pm.get_hookcallers(pm.get_plugins().pop())} - LIFECYCLE
    folder = str(path.parent.relative_to(ROOT))
    allowed = KIND_FOLDERS[folder]
    assert (hooks or not allowed) and hooks <= allowed, (  # a lifecycle folder (allowed: none) registers nothing
        f"{path.relative_to(ROOT)} implements {sorted(hooks) or 'no kind hook'}; modules in {folder}/ implement "
        f"{sorted(allowed)}: move it to the folder of the kind it registers")


@pytest.mark.parametrize("ep", installed_entry_points(), ids=lambda ep: ep.name)
def test_every_entry_point_imports_and_is_a_valid_plugin(ep):
    assert ep.module.startswith(FORBIDDEN), f"entry point {ep.name} = {ep.value!r} is outside plugins/, losses/, rewards/"
    module = ep.load()
    pm = pluggy.PluginManager("plait")
    pm.add_hookspecs(hookspecs)
    pm.register(module, name=ep.name)  # validates every hookimpl's signature
    pm.check_pending()  # and that every hookimpl names a real hook
    assert pm.get_hookcallers(module), f"{ep.value} implements no plait hook"


def imported_modules(path: Path, core: Path = ROOT / "core") -> list[tuple[int, str]]:
    """Every module a file of ``core`` (the package ``plait``) imports, relative and dynamic
    imports resolved, with line numbers."""
    package = ".".join(("plait", *path.relative_to(core).parent.parts))
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found += [(node.lineno, module)] + [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def test_import_scanner_sees_relative_and_dynamic_imports(tmp_path):
    fake = tmp_path / "core" / "testing" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from .. import losses\nfrom ..plugins import dpo\nfrom . import helpers\n"
                    "import importlib\nimportlib.import_module('plait.rewards.x')\n")
    assert [m for _, m in imported_modules(fake, core=tmp_path / "core")] == [
        "plait", "plait.losses", "plait.plugins", "plait.plugins.dpo", "plait.testing", "plait.testing.helpers",
        "importlib", "plait.rewards.x"]


def test_core_never_imports_plugin_folders():
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "core").rglob("*.py"))
        for line, module in imported_modules(path)
        if module == "plait.plugins" or module.startswith(FORBIDDEN)
    ]
    assert not offences, f"core/ must find components through the registry, not import them: {offences}"


HOOKS = sorted(name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "plait_spec"))


def test_hookspecs_are_found():
    assert {"register_losses", "register_methods", "register_commands", "detect_data_format"} <= set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hookspec_has_a_docstring(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert len(doc.split()) >= 5, f"hookspec {hook} needs a docstring: what, when it is called, what to return"


def architecture_section() -> str:
    """docs/architecture.md, the page the README links for where every module lives."""
    return (ROOT / "docs" / "architecture.md").read_text()


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_in_the_architecture_page(hook):
    assert re.search(rf"\b{hook}\b", architecture_section()), f"docs/architecture.md never mentions {hook}"


# -- core's rooms: the kernel at the root, subpackages named after what they hold -------------------------------
# Imports flow one way: kernel <- data <- engine <- online <- trl / recipes <- testing. The package face
# (plait/__init__.py) and the command (plait/cli.py) may reach up lazily, inside functions, to keep
# `import plait` and `plait --help` light; nothing else imports against the flow, and nothing forms a cycle.
LAYERS = {"plait.data": 1, "plait.engine": 2, "plait.online": 3, "plait.trl": 4, "plait.recipes": 4, "plait.testing": 5}
FACE = {"plait", "plait.cli"}
# ... and `import plait` itself page-aligns torch's large CPU buffers before torch's first tensor (plait.engine.memory)
AT_IMPORT = {("plait", "plait.engine.memory")}
LIBRARY = {"core": "plait", "plugins": "plait.plugins", "losses": "plait.losses", "rewards": "plait.rewards"}


@functools.cache
def library_modules() -> dict[str, Path]:
    modules = {}
    for folder, package in LIBRARY.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join((package, *parts))] = path
    return modules


def layer(module: str) -> int:
    return next((rank for package, rank in LAYERS.items() if module == package or module.startswith(package + ".")), 0)


def import_edges() -> list[tuple[str, str, bool]]:
    """(importer, imported library module, at module level?) for every import in the library."""
    modules, edges = library_modules(), []
    for importer, path in modules.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]

        def visit(node, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(child, ast.ImportFrom):
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1]) if child.level else ""
                    target = ".".join(p for p in (base, child.module) if p)
                    for alias in child.names:
                        name = f"{target}.{alias.name}"
                        found = name if name in modules else target if target in modules else None
                        if found and found != importer:
                            edges.append((importer, found, not in_function))
                elif isinstance(child, ast.Import):
                    edges.extend((importer, a.name, not in_function) for a in child.names if a.name in modules)
                else:
                    visit(child, nested)

        visit(ast.parse(path.read_text()), False)
    return edges


def test_core_imports_flow_one_way():
    in_core = {m for m, path in library_modules().items() if (ROOT / "core") in path.parents}
    against = [f"{a} imports {b}" for a, b, top in import_edges()
               if a in in_core and layer(b) > layer(a) and (top or a not in FACE) and (a, b) not in AT_IMPORT]
    assert not against, f"imports against kernel <- data <- engine <- online <- trl/recipes: {against}"


def test_the_library_has_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for a, b, _ in import_edges():
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if state.get(nxt) is None and (found := cycle_from(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if state.get(start) is None and (found := cycle_from(start, [start])):
            pytest.fail(f"import cycle (module- or function-level): {' -> '.join(found)}")


def test_no_private_module_is_imported_from_another_package():
    private = [f"{a} imports {b}" for a, b, _ in import_edges()
               if b.rpartition(".")[2].startswith("_") and not b.endswith("__init__")
               and b.rpartition(".")[0] != (a if library_modules()[a].name == "__init__.py" else a.rpartition(".")[0])]
    assert not private, f"a private module (_name) serves its own package only; make shared code public: {private}"


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT / "core") for p in (ROOT / "core").rglob("*.py")
                                        if p.name != "__init__.py" and "testing" not in p.parts), ids=str)
def test_every_core_module_is_in_the_architecture_page(path):
    assert re.search(rf"\b{re.escape(path.name)}\b", architecture_section()), (
        f"docs/architecture.md never mentions core/{path}")
