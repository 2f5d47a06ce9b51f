"""The plugin manager: hook validation, entry-point discovery, blocking, import-error policy, tracing.

Third-party plugins are real modules written to a temporary folder on ``sys.path``, announced by
real ``importlib.metadata`` distributions (a ``*.dist-info`` folder read by ``PathDistribution``)
that a monkeypatched ``importlib.metadata.entry_points`` returns next to plait's own
``dpo_sigmoid``. Every test builds its own manager with ``plait.make_plugins``.
"""

import importlib.metadata
import logging
import sys
import textwrap
import types
import uuid

import pluggy
import pytest

import plait
from plait.errors import PluginLoadError
from plait.registry import DisabledComponentError, DuplicateComponentError, UnknownComponentError

BUILTIN = [ep for ep in importlib.metadata.entry_points(group="plait") if ep.name == "dpo_sigmoid"]

HINGE = '''
"""A third party's hinge loss."""
import attrs
from plait import hookimpl

@attrs.frozen
class HingeParams:
    beta: float = 0.1

def hinge(batch, p):
    return max(0.0, 1 - p.beta * batch)

@hookimpl
def register_losses(register):
    register("fake.hinge", hinge, params=HingeParams)
'''

BROKEN = 'raise ImportError("No module named \'fancy_kernels\'")\n'


def registers(name: str, kind: str = "losses") -> str:
    return f"from plait import hookimpl\n\n@hookimpl\ndef register_{kind}(register):\n    register({name!r}, print)\n"


def plugin(name: str, **hooks) -> types.ModuleType:
    """An in-test plugin: a module object carrying hookimpl-marked functions, like an installed one."""
    module = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(module, hook_name, plait.hookimpl(fn))
    return module


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """``install(entry_point, source, dist=..., version=...)`` installs a fake plugin distribution."""
    src, meta = tmp_path / "src", tmp_path / "meta"
    src.mkdir()
    meta.mkdir()
    monkeypatch.syspath_prepend(str(src))
    modules = []

    def install(ep_name: str, source: str, dist: str = "plait-fake", version: str = "1.2.3") -> str:
        module = f"plait_fake_{ep_name}_{uuid.uuid4().hex[:8]}"  # unique: sys.modules caches imports
        (src / f"{module}.py").write_text(textwrap.dedent(source))
        info = meta / f"{dist.replace('-', '_')}-{version}.dist-info"
        if not info.exists():
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
            (info / "entry_points.txt").write_text("[plait]\n")
        with open(info / "entry_points.txt", "a") as f:
            f.write(f"{ep_name} = {module}\n")
        modules.append(module)
        return module

    def entry_points(**selection):
        found = list(BUILTIN)
        for info in sorted(meta.glob("*.dist-info")):
            found += importlib.metadata.PathDistribution(info).entry_points
        return importlib.metadata.EntryPoints(found).select(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    yield install
    for module in modules:
        sys.modules.pop(module, None)


# -- hook validation ----------------------------------------------------------------------------


def test_hookimpl_with_an_argument_not_in_the_spec_is_rejected_naming_plugin_and_argument():
    bad = plugin("bad_args", register_losses=lambda register, extra: None)
    with pytest.raises(pluggy.PluginValidationError, match="bad_args") as err:
        plait.make_plugins(autoload=False, plugins=[bad])
    assert "extra" in str(err.value) and "register_losses" in str(err.value)


def test_hookimpl_may_take_a_subset_of_the_spec_arguments():
    plugins = plait.make_plugins(autoload=False, plugins=[plugin("quiet", register_losses=lambda: None)])
    assert len(plugins.losses) == 0


def test_misspelt_hook_name_fails_loudly_at_check_pending():
    typo = plugin("typo", register_loss=lambda register: register("x.y", print))
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'register_loss'.*typo"):
        plait.make_plugins(autoload=False, plugins=[typo])


def test_misspelt_hook_registered_by_hand_also_fails():
    plugins = plait.make_plugins(autoload=False)
    with pytest.raises(pluggy.PluginValidationError, match="register_reward"):
        plugins.register(plugin("typo", register_reward=lambda register: None), name="typo")


def test_managers_are_independent():
    first = plait.make_plugins(autoload=False)
    first.register(plugin("mine", register_losses=lambda register: register("mine.loss", print)), name="mine")
    second = plait.make_plugins(autoload=False)
    assert "mine.loss" in first.losses and "mine.loss" not in second.losses


def test_built_in_loss_is_found_through_its_entry_point():
    plugins = plait.make_plugins()
    sigmoid = plugins.losses.get("dpo.sigmoid")
    assert (sigmoid.plugin, sigmoid.distribution, sigmoid.version) == ("dpo_sigmoid", "plait", plait.__version__)
    assert plugins.hooks_of("dpo_sigmoid") == ["register_losses"]


# -- third-party discovery ----------------------------------------------------------------------


def test_third_party_loss_is_resolvable_with_distribution_and_version(third_party):
    module = third_party("fake_hinge", HINGE)
    plugins = plait.make_plugins()
    hinge = plugins.losses.get("fake.hinge")
    assert hinge.obj.__module__ == module
    assert (hinge.plugin, hinge.distribution, hinge.version) == ("fake_hinge", "plait-fake", "1.2.3")
    assert hinge.obj(2.0, hinge.make_params(beta=0.25)) == 0.5
    assert hinge.summary == "A third party's hinge loss."
    assert "dpo.sigmoid" in plugins.losses  # the built-in loads beside it
    info = plugins.info("fake_hinge")
    assert (info.distribution, info.version, info.module) == ("plait-fake", "1.2.3", module)
    assert plugins.hooks_of("fake_hinge") == ["register_losses"]


@pytest.mark.parametrize("block", ["fake_hinge", "plait-fake"], ids=["entry-point", "distribution"])
def test_disable_argument_blocks_a_plugin_before_it_is_imported(third_party, block):
    module = third_party("fake_hinge", HINGE)
    plugins = plait.make_plugins(disable=[block])
    assert "fake.hinge" not in plugins.losses and "dpo.sigmoid" in plugins.losses
    assert module not in sys.modules


def test_env_var_blocks_named_plugins(third_party, monkeypatch):
    third_party("fake_hinge", HINGE)
    monkeypatch.setenv("PLAIT_DISABLE_PLUGINS", " other , fake_hinge")
    plugins = plait.make_plugins()
    assert plugins.losses.names() == ["dpo.sigmoid"]


def test_blocking_a_broken_plugin_lets_the_rest_load(third_party):
    third_party("broken", BROKEN)
    assert plait.make_plugins(disable=["broken"]).losses.names() == ["dpo.sigmoid"]


@pytest.mark.parametrize("how", ["env", "argument"])
def test_autoload_off_loads_nothing_but_hand_registered_plugins(third_party, monkeypatch, how):
    module = third_party("fake_hinge", HINGE)
    mine = plugin("mine", register_losses=lambda register: register("mine.loss", print))
    if how == "env":
        monkeypatch.setenv("PLAIT_DISABLE_PLUGIN_AUTOLOAD", "1")
        plugins = plait.make_plugins(plugins=[mine])
    else:
        plugins = plait.make_plugins(autoload=False, plugins=[mine])
    assert plugins.losses.names() == ["mine.loss"]
    assert [name for name, _ in plugins.pm.list_name_plugin()] == ["mine"]
    assert module not in sys.modules


@pytest.mark.parametrize("how", ["env", "argument"])
def test_disabling_an_unknown_plugin_warns_with_a_close_match(third_party, monkeypatch, caplog, how):
    third_party("fake_hinge", HINGE)
    caplog.set_level(logging.WARNING, logger="plait")
    typo = f"fake_hinje_{how}"  # each test its own name: the warning is given once per process
    if how == "env":
        monkeypatch.setenv("PLAIT_DISABLE_PLUGINS", typo)
        plugins = plait.make_plugins()
    else:
        plugins = plait.make_plugins(disable=[typo])
    assert "fake.hinge" in plugins.losses  # nothing was disabled
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    source = "PLAIT_DISABLE_PLUGINS" if how == "env" else "plugins.disable"
    assert f"{source} names '{typo}', which is no installed plugin or distribution" in warning
    assert "did you mean 'fake_hinge'?" in warning


def test_disabling_a_plugin_by_its_distribution_name_gives_no_warning(third_party, caplog):
    third_party("fake_hinge", HINGE)
    caplog.set_level(logging.WARNING, logger="plait")
    assert "fake.hinge" not in plait.make_plugins(disable=["plait-fake"]).losses
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("how", ["env", "argument", "distribution"])
def test_a_component_of_a_disabled_plugin_says_it_is_disabled_and_by_what(third_party, monkeypatch, how):
    module = third_party("fake_hinge", HINGE)
    if how == "env":
        monkeypatch.setenv("PLAIT_DISABLE_PLUGINS", "other,fake_hinge")
        plugins, by, fix = plait.make_plugins(), "PLAIT_DISABLE_PLUGINS=other,fake_hinge", "remove fake_hinge from PLAIT_DISABLE_PLUGINS"
    else:
        token = "fake_hinge" if how == "argument" else "plait-fake"
        plugins, by, fix = plait.make_plugins(disable=[token]), "the recipe's plugins.disable", f"remove {token} from it"
    assert module not in sys.modules  # disabling still means not imported, until a lookup needs the reason
    with pytest.raises(DisabledComponentError) as err:
        plugins.losses.get("hinge", family="fake")
    message = str(err.value)
    assert message.startswith("loss 'fake.hinge' comes from plugin 'fake_hinge' (plait-fake 1.2.3), which is disabled by ")
    assert by in message and fix in message
    with pytest.raises(UnknownComponentError, match="unknown loss 'fake.other'"):  # other names: the usual error
        plugins.losses.get("fake.other")


def test_with_autoload_off_an_unknown_name_says_no_plugin_was_loaded(monkeypatch):
    monkeypatch.setenv("PLAIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.raises(UnknownComponentError) as err:
        plait.make_plugins().losses.get("dpo.sigmoid")
    assert "plugin autoload is off (PLAIT_DISABLE_PLUGIN_AUTOLOAD=1), so no installed plugin was loaded" in str(err.value)


# -- import errors --------------------------------------------------------------------------------


def test_broken_plugin_is_reported_by_entry_point_and_distribution(third_party):
    module = third_party("broken", BROKEN, dist="plait-broken", version="0.0.1")
    with pytest.raises(PluginLoadError) as err:
        plait.make_plugins()
    message = str(err.value)
    assert "\n" not in message
    for phrase in ("'broken'", module, "plait-broken 0.0.1", "ImportError", "fancy_kernels",
                   "PLAIT_DISABLE_PLUGINS=broken", "PLAIT_ON_PLUGIN_ERROR=skip"):
        assert phrase in message
    assert isinstance(err.value.__cause__, ImportError)
    assert "fancy_kernels" in str(err.value.__cause__)


def test_plugin_with_a_bad_hook_signature_is_reported_by_entry_point(third_party):
    third_party("wrong_args", "from plait import hookimpl\n\n@hookimpl\ndef register_losses(register, beta):\n    pass\n")
    with pytest.raises(PluginLoadError, match="'wrong_args'.*plait-fake 1.2.3") as err:
        plait.make_plugins()
    assert isinstance(err.value.__cause__, pluggy.PluginValidationError)


def test_installed_plugin_with_a_misspelt_hook_fails_loudly(third_party):
    module = third_party("typo", registers("fake.typo", kind="loss"))  # register_loss, not register_losses
    with pytest.raises(pluggy.PluginValidationError, match=f"unknown hook 'register_loss' in plugin <module '{module}'"):
        plait.make_plugins()


@pytest.mark.parametrize("how", ["env", "argument"])
def test_skip_policy_warns_and_loads_the_others(third_party, monkeypatch, caplog, how):
    third_party("broken", BROKEN, dist="plait-broken", version="0.0.1")
    third_party("fake_hinge", HINGE)
    caplog.set_level(logging.WARNING, logger="plait")
    if how == "env":
        monkeypatch.setenv("PLAIT_ON_PLUGIN_ERROR", "skip")
        plugins = plait.make_plugins()
    else:
        plugins = plait.make_plugins(on_import_error="skip")
    assert plugins.losses.names() == ["dpo.sigmoid", "fake.hinge"]
    assert not plugins.pm.has_plugin("broken")
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "'broken'" in warning.getMessage() and "plait-broken 0.0.1" in warning.getMessage()


@pytest.mark.parametrize("source, shown", [
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
    ("class Abort(BaseException):\n    pass\n\nraise Abort('cannot run here')\n", "Abort: cannot run here"),
], ids=["SystemExit", "BaseException"])
def test_plugin_raising_a_base_exception_on_import_is_reported_like_any_broken_plugin(third_party, source, shown):
    third_party("quitter", source, dist="plait-quitter", version="0.2")
    with pytest.raises(PluginLoadError) as err:
        plait.make_plugins()
    assert "'quitter'" in str(err.value) and "plait-quitter 0.2" in str(err.value) and shown in str(err.value)
    assert plait.make_plugins(on_import_error="skip").losses.names() == ["dpo.sigmoid"]


def test_keyboard_interrupt_during_a_plugin_import_still_interrupts(third_party):
    third_party("interrupted", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        plait.make_plugins()


def test_unknown_import_error_policy_is_rejected():
    with pytest.raises(PluginLoadError, match="on_import_error='maybe'.*'fail' or 'skip'"):
        plait.make_plugins(autoload=False, on_import_error="maybe")


# -- duplicates -----------------------------------------------------------------------------------


def test_same_name_from_two_distributions_is_an_error_naming_both(third_party):
    third_party("one", registers("fake.same"), dist="plait-one", version="1.0")
    third_party("two", registers("fake.same"), dist="plait-two", version="2.0")
    plugins = plait.make_plugins()
    with pytest.raises(DuplicateComponentError) as err:
        plugins.losses
    message = str(err.value)
    assert "'fake.same'" in message and "one (plait-one 1.0)" in message and "two (plait-two 2.0)" in message


def test_third_party_cannot_silently_replace_a_built_in(third_party):
    third_party("impostor", registers("dpo.sigmoid"))
    with pytest.raises(DuplicateComponentError, match="dpo_sigmoid \\(plait .*impostor \\(plait-fake 1.2.3\\)"):
        plait.make_plugins().losses


def test_duplicate_between_hand_registered_plugins_names_both():
    plugins = plait.make_plugins(autoload=False)
    plugins.register(plugin("alpha", register_rewards=lambda register: register("reward.len", len)), name="alpha")
    plugins.register(plugin("beta", register_rewards=lambda register: register("reward.len", len)), name="beta")
    with pytest.raises(DuplicateComponentError, match="by alpha .* by beta"):
        plugins.rewards


# -- tracing --------------------------------------------------------------------------------------


def traced_plugin():
    return plugin(
        "tracer",
        register_losses=lambda register: register("trace.loss", print),
        detect_data_format=lambda example, columns: "format.traced" if "x" in columns else None,
    )


def test_trace_env_var_prints_hook_calls_to_stderr(monkeypatch, capsys):
    monkeypatch.setenv("PLAIT_TRACE_HOOKS", "1")
    plugins = plait.make_plugins(autoload=False, plugins=[traced_plugin()])
    plugins.losses
    assert plugins.hook.detect_data_format(example={"x": 1}, columns=["x"]) == "format.traced"
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[plait trace] register_losses -> tracer" in captured.err
    assert "detect_data_format" in captured.err and "format.traced" in captured.err


def test_no_trace_without_the_env_var(capsys):
    plugins = plait.make_plugins(autoload=False, plugins=[traced_plugin()])
    plugins.losses
    plugins.hook.detect_data_format(example={"x": 1}, columns=["x"])
    assert capsys.readouterr().err == ""
