"""Registries: dotted names, duplicates, did-you-mean errors, provenance, component parameters."""

import math
import re

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import plait
from plait.errors import PlaitError
from plait.hookspecs import AdvantageOptions, Options, kinds
from plait.params import in_range, positive
from plait.registry import (
    NAME_PATTERN,
    Component,
    DuplicateComponentError,
    Registry,
    UnknownComponentError,
    register_callback,
)

_LOWER = "abcdefghijklmnopqrstuvwxyz0123456789_"
# every name NAME_PATTERN accepts: a family, then one or more dot-separated parts
names = st.builds(
    lambda family, parts: ".".join([family, *parts]),
    st.text(_LOWER, min_size=1, max_size=8),
    st.lists(st.text(_LOWER + "-", min_size=1, max_size=10), min_size=1, max_size=2),
)

# Names "far apart": each variant is spelt from its own group of characters, none repeated
# (difflib matches blocks greedily, so in 'aabaaa' vs 'aaaaaa' it finds only 3 of 5 common
# characters), and families use none of them. Then a one-character edit of a name keeps
# difflib's ratio to it >= 0.8 while its ratio to any other name stays below the 0.6 cutoff.
GROUPS = ["abcdefgh", "ijklmnop", "qrstuvwx", "01234567"]
FAMILIES = ["y", "z", "yz", "z_y", "y9"]


@st.composite
def far_apart_names(draw):
    groups = draw(st.lists(st.sampled_from(GROUPS), min_size=1, max_size=len(GROUPS), unique=True))
    return [
        f"{draw(st.sampled_from(FAMILIES))}.{''.join(draw(st.permutations(group))[:draw(st.integers(5, 7))])}"
        for group in groups
    ]


def one_edit(data, word: str) -> str:
    """Delete, swap with its neighbour, or replace one character of ``word``."""
    i = data.draw(st.integers(0, len(word) - 1), label="position")
    edit = data.draw(st.sampled_from(["delete", "swap", "replace"]), label="edit")
    if edit == "delete":
        return word[:i] + word[i + 1:]
    if edit == "swap":
        assume(i + 1 < len(word))
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    group = next(g for g in GROUPS if word[i] in g)
    return word[:i] + data.draw(st.sampled_from([c for c in group if c not in word]), label="char") + word[i + 1:]


def filled(registered, kind="loss", plugin="plug", distribution="dist", version="1.0"):
    registry = Registry(kind)
    register = register_callback(registry, plugin, distribution, version)
    for name in registered:
        register(name, object())
    return registry


# -- properties ---------------------------------------------------------------------------------


@given(st.sets(names, max_size=20))
def test_every_registered_name_resolves_to_itself(registered):
    registry = Registry("loss")
    register = register_callback(registry, "plug", "some-dist", "2.0")
    objects = {name: object() for name in registered}
    for name, obj in objects.items():
        register(name, obj)
    for name, obj in objects.items():
        component = registry.get(name)
        assert component.name == name and component.obj is obj
        assert (component.plugin, component.distribution, component.version) == ("plug", "some-dist", "2.0")
        assert name in registry
    assert registry.names() == sorted(registered) == [c.name for c in registry]
    assert len(registry) == len(registered)


@given(far_apart_names(), st.data())
def test_near_miss_suggests_the_name_it_was_made_from(registered, data):
    registry = filled(registered)
    target = data.draw(st.sampled_from(registered), label="target")
    family, variant = target.split(".", 1)
    miss = f"{family}.{one_edit(data, variant)}"
    with pytest.raises(UnknownComponentError) as err:
        registry.get(miss)
    assert f"unknown loss {miss!r} (did you mean {target!r}?)" in str(err.value)


@given(far_apart_names(), st.data())
def test_near_miss_of_a_bare_variant_within_a_family_suggests_its_full_name(registered, data):
    registry = filled(registered)
    target = data.draw(st.sampled_from(registered), label="target")
    family, variant = target.split(".", 1)
    assert registry.get(variant, family=family) is registry.get(target)
    miss = one_edit(data, variant)
    with pytest.raises(UnknownComponentError) as err:
        registry.get(miss, family=family)
    assert f"unknown loss {miss!r} (did you mean {target!r}?)" in str(err.value)


@given(st.lists(names, min_size=1, max_size=10, unique=True), st.data())
def test_duplicates_are_always_rejected_naming_both_plugins(registered, data):
    registry = filled(registered, plugin="first", distribution="dist-a", version="1.0")
    again = data.draw(st.sampled_from(registered), label="duplicate")
    original = registry.get(again)
    with pytest.raises(DuplicateComponentError) as err:
        register_callback(registry, "second", "dist-b", "2.0")(again, object())
    message = str(err.value)
    assert f"loss {again!r} is registered twice" in message
    assert "by first (dist-a 1.0) and by second (dist-b 2.0)" in message
    assert registry.get(again) is original and len(registry) == len(registered)


@given(st.sets(names, max_size=8), names)
def test_unknown_name_error_lists_every_available_name(registered, unknown):
    assume(unknown not in registered)
    registry = filled(registered)
    with pytest.raises(UnknownComponentError) as err:
        registry.get(unknown)
    message = str(err.value)
    assert "\n" not in message
    assert message.endswith("available: " + (", ".join(sorted(registered)) or "none are installed"))


@given(st.from_regex(r"[a-z0-9_]+|[A-Za-z]+\.[A-Z][a-z]*|\.[a-z]+|[a-z]+\.", fullmatch=True))
def test_names_that_are_not_dotted_lower_case_are_rejected(bad):
    with pytest.raises(PlaitError, match="from plugin 'plug' is not dotted lower-case"):
        filled([bad])


# -- lookups through a plugin manager ------------------------------------------------------------


def dpo_like_plugin():
    @plait.hookimpl
    def register_losses(register):
        register("dpo.sigmoid", print)
        register("dpo.hinge", print)
        register("kto.sigmoid", print)

    return type("DpoLike", (), {"register_losses": staticmethod(register_losses)})


def test_family_lookup_finds_the_bare_variant():
    losses = plait.make_plugins(autoload=False, plugins=[dpo_like_plugin()]).losses
    assert losses.get("sigmoid", family="dpo").name == "dpo.sigmoid"
    assert losses.get("sigmoid", family="kto").name == "kto.sigmoid"
    assert losses.get("dpo.hinge", family="kto").name == "dpo.hinge"  # a full name wins outright
    assert [c.name for c in losses.family("dpo")] == ["dpo.hinge", "dpo.sigmoid"]
    with pytest.raises(UnknownComponentError, match="did you mean 'dpo.sigmoid'"):
        losses.get("sigmod", family="dpo")
    # within a family the family's names are listed (the dpo losses are not the kto ones), and where all are
    with pytest.raises(UnknownComponentError, match=r"^unknown loss 'hinge'; available: kto.sigmoid \(the kto losses; "
                                                    r"'plait list losses' lists all 3\);"):
        losses.get("hinge", family="kto")


def test_installed_dpo_sigmoid_is_found_by_family_and_misspelling():
    losses = plait.make_plugins().losses
    assert losses.get("sigmoid", family="dpo") is losses.get("dpo.sigmoid")
    with pytest.raises(UnknownComponentError, match="unknown loss 'dpo.sigmod' \\(did you mean 'dpo.sigmoid'\\?\\)"):
        losses.get("dpo.sigmod")


def test_unknown_component_error_is_a_key_error_with_a_readable_message():
    with pytest.raises(KeyError) as err:
        Registry("reward").get("reward.nothing")
    assert str(err.value) == "unknown reward 'reward.nothing'; available: none are installed"


# -- components and their parameters --------------------------------------------------------------


@attrs.frozen
class Params:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))


def loss(batch, p):
    """A test loss.

    More text that the summary leaves out.
    """


LOSS = Component(kind="loss", name="test.loss", obj=loss, params=Params)


def test_make_params_builds_defaults_and_given_values():
    assert LOSS.make_params() == Params()
    assert LOSS.make_params(beta=0.5, label_smoothing=0.25) == Params(0.5, 0.25)


def test_make_params_rejects_an_unknown_parameter_with_a_suggestion():
    with pytest.raises(PlaitError) as err:
        LOSS.make_params(betta=0.2)
    assert str(err.value) == (
        "loss 'test.loss': unknown parameter 'betta' (did you mean 'beta'?); accepted: ['beta', 'label_smoothing']"
    )


@given(st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.just(math.inf), st.text(max_size=3), st.booleans()))
def test_make_params_wraps_validator_errors_naming_the_component(beta):
    with pytest.raises(PlaitError) as err:
        LOSS.make_params(beta=beta)
    assert str(err.value) == f"loss 'test.loss': beta={beta!r} must be a number > 0"
    assert isinstance(err.value.__cause__, ValueError)


def test_component_without_params_rejects_any():
    with pytest.raises(PlaitError, match="reward 'reward.len' takes no parameters, got \\['scale'\\]"):
        Component(kind="reward", name="reward.len", obj=len).make_params(scale=2)
    assert Component(kind="reward", name="reward.len", obj=len).make_params() is None


def test_params_must_be_an_attrs_class():
    register = register_callback(Registry("loss"), "plug", "dist", "1.0")
    with pytest.raises(PlaitError, match="loss 'x.y' from plugin 'plug' \(dist 1.0\): params must be an attrs class"):
        register("x.y", loss, params=dict)


def test_register_keeps_doc_and_options():
    registry = Registry("loss")
    register_callback(registry, "plug", "dist", "1.0")("test.loss", loss, params=Params, output="token", batch_coupled=True)
    register_callback(registry, "plug", "dist", "1.0")("test.doc", loss, doc="Given explicitly.\nSecond line.")
    options = registry.get("test.loss").options
    assert (options.output, options.batch_coupled, options.f_divergence) == ("token", True, False)
    assert options.metrics is None and options.declared() == {"output": "token", "batch_coupled": True}
    assert registry.get("test.loss").summary == "A test loss."
    assert registry.get("test.doc").summary == "Given explicitly."


# -- typed options --------------------------------------------------------------------------------


def test_a_misspelt_option_names_the_plugin_the_kind_and_the_accepted_ones():
    register = register_callback(Registry("loss"), "plug", "dist", "1.0", module="plug_pkg.losses")
    with pytest.raises(PlaitError) as err:
        register("test.loss", loss, consume=object)
    assert str(err.value) == (
        "loss 'test.loss' from plugin 'plug' (plug_pkg.losses, dist 1.0): unknown option 'consume' (did you mean "
        "'consumes'?); a loss accepts consumes, output, reduces, monotone, batch_coupled, f_divergence, sorts_batch, "
        "metrics, cpo_alpha (besides params= and doc=)")


@pytest.mark.parametrize("kind, options, message", [
    ("loss", {"output": "tokens"}, "option 'output' must be in ('example', 'token', 'scalar') (got 'tokens')"),
    ("loss", {"batch_coupled": "yes"}, "option 'batch_coupled' must be <class 'bool'>"),
    ("reward", {"completion_format": "chat"}, "option 'completion_format' must be in"),
    ("environment", {"owns_reward": 0}, "option 'owns_reward' must be <class 'bool'>"),
    ("packing strategy", {"padding_free": None}, "option 'padding_free' must be <class 'bool'>"),
    ("judge", {"images": True}, "unknown option 'images'; a judge accepts no options"),
])
def test_a_mistyped_option_is_one_line_naming_the_option(kind, options, message):
    with pytest.raises(PlaitError, match=re.escape(message)) as err:
        register_callback(Registry(kind), "plug", "dist", "1.0")("test.thing", loss, **options)
    assert "\n" not in str(err.value) and "plugin 'plug' (dist 1.0)" in str(err.value)


def test_every_kind_has_typed_options_with_defaults():
    for kind in kinds().values():
        assert issubclass(kind.options, Options) and kind.options() is not None  # every option is optional
        assert Registry(kind.singular).options is kind.options


def test_a_component_made_by_hand_gets_its_kinds_default_options():
    assert Component(kind="loss", name="test.loss", obj=loss).options.reduction == "example"
    assert Component(kind="environment", name="env.x", obj=loss).options.owns_reward is True
    assert Component(kind="advantage estimator", name="advantage.x", obj=loss, options=AdvantageOptions(
        token_level=True)).options.is_group_relative is False
