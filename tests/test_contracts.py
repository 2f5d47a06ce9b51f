"""plait.testing: every built-in passes the contracts, and broken components are caught by name.

The built-in parametrisations read the registry, so a new loss, reward or advantage estimator
shipped by plait is checked without touching this file.
"""

from __future__ import annotations

import asyncio
import functools
import math
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from plait import hookimpl, make_plugins
from plait.errors import PlaitError
from plait.hookspecs import kinds
from plait.engine.batches import PreferenceLogps, Rollout, TokenLogps, UnpairedLogps
from plait.params import positive
from plait.testing import (
    ContractViolation,
    check_advantage_estimator,
    check_callbacks,
    check_component,
    check_loss,
    check_reward,
    describe,
    preference_logps,
    rollouts,
    take,
    token_logps,
    unpaired_logps,
)
from plait.testing.contracts import CHECKS
from plait.testing.tiny_model import tiny_model_path

KINDS = kinds()  # every kind of component, from the hookspecs


def builtins(registry: str) -> list[str]:
    """plait's own components of a registry (tool-call parsers share the environments' registry: not episodes)."""
    return [c.name for c in make_plugins().registries[registry]
            if c.distribution == "plait" and not c.name.startswith("env.parser.")]


def tiny_prm_folder(root: Path) -> str:
    """An untrained process reward model (the tiny model with a two-label token head): what reward.prm loads."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    folder = root / "prm"
    AutoModelForTokenClassification.from_pretrained(tiny_model_path(), num_labels=2).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(folder)
    return str(folder)


def tiny_reward_model_folder(root: Path) -> str:
    """An untrained one-label sequence classifier on the tiny model: what judge.reward_model loads."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = root / "rm"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(folder)
    return str(folder)


def served_reward(root: Path) -> dict:
    """What reward.remote calls: an in-process ``plait reward-serve`` on loopback scoring completion lengths
    (a daemon thread, gone with the test process), and the file holding its token."""
    import threading

    from plait.plugins.commands.reward_serve import RewardServer

    def length(prompts, completions, **kwargs):
        return [float(len(str(c))) for c in completions]

    server = RewardServer(("127.0.0.1", 0), {"length": length}, max_batch_size=64, batch_window=0.0, token="contract",
                          max_connections=8, header_timeout=10, max_body_bytes=2**22, body_timeout=10)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (root / "token").write_text("contract")
    (root / "token").chmod(0o600)  # the client refuses a token others can read
    return {"url": f"http://127.0.0.1:{server.server_address[1]}", "token_file": str(root / "token"),
            "reward": "length"}


# Built-ins that need a real artifact (or another component) to build: their arguments for the check.
ARTIFACTS = {
    "reward.remote": lambda root: {"params": served_reward(root)},
    "reward.prm": lambda root: {"params": {"model": tiny_prm_folder(root)}},
    "judge.reward_model": lambda root: {"params": {"model": tiny_reward_model_folder(root)}},
    "judge.pairwise": lambda root: {"params": {"model": str(tiny_model_path())}},
    "judge.rules": lambda root: {"params": {"rewards": ["think_format"]}},
    "collator.images": lambda root: {"options": {"inner": inner_collator()}},
}


def inner_collator():
    """What collator.images wraps: a text collator."""
    from transformers import AutoTokenizer

    return make_plugins().collators.get("collator.language_modeling").obj(AutoTokenizer.from_pretrained(tiny_model_path()))


def _reference_detached_by_batches() -> bool:
    """Whether plait.engine.batches' log-ratio properties cut the gradient into the reference log-probs."""
    ref = torch.zeros(1, requires_grad=True)
    batch = PreferenceLogps(torch.zeros(1), torch.zeros(1), ref, torch.zeros(1), torch.ones(1), torch.ones(1))
    return not batch.chosen_logratios.requires_grad


@pytest.mark.parametrize("registry, name", [(r, n) for r in KINDS for n in builtins(r)])
def test_every_builtin_satisfies_its_contract(registry, name, tmp_path):
    plugins = make_plugins()
    component = plugins.registries[registry].get(name)
    arguments = ARTIFACTS[name](tmp_path) if name in ARTIFACTS else {}
    try:
        checked = check_component(component, plugins, **arguments)
    except ContractViolation as violation:
        if violation.property == "builds from its parameters" and "not installed" in str(violation.__cause__):
            pytest.skip(str(violation.__cause__))  # an optional extra (math-verify) is missing here
        raise
    assert len(checked) >= 1


def test_the_kit_covers_the_kinds_the_registry_has():
    assert {kind.singular for kind in KINDS.values()} == set(CHECKS)
    assert len(builtins("losses")) >= 20  # DPO, KTO, SFT and reward-model losses are all checked


def test_every_builtin_trainer_callback_hook_answers_with_callbacks():
    plugins = make_plugins()
    hooked = [impl.plugin_name for impl in plugins.hook.trainer_callbacks.get_hookimpls()]
    assert hooked  # PPO's adaptive KL controller, at least
    for plugin in hooked:
        for method in plugins.methods:
            assert check_callbacks(plugin, method.name, plugins=plugins) == ["returns TrainerCallbacks"]
    adaptive = plugins.methods.get("method.ppo").obj.config(target_kl=0.1)  # one that does answer
    assert any(check_callbacks(plugin, "ppo", adaptive, plugins) for plugin in hooked)


def test_every_batch_class_a_builtin_loss_consumes_has_its_own_strategy():
    # The generic fallback guesses [B] tensors from field names; plait's own batches deserve better.
    from plait.testing.strategies import BATCH_KINDS

    plugins = make_plugins()
    unknown = {plugins.losses.get(name).options.consumes for name in builtins("losses")} - set(BATCH_KINDS)
    assert not unknown, f"add a BatchKind for {unknown} to core/testing/strategies.py"


# ---------------------------------------------------------------------------------------------
# Broken losses are caught, with the property and the input in the message
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Beta:
    beta: float = attrs.field(default=0.1, validator=positive)


def margin(batch: PreferenceLogps) -> torch.Tensor:
    """Δ with the reference detached, so only the property under test can fail."""
    chosen = batch.chosen_logps - batch.ref_chosen_logps.detach()
    return chosen - (batch.rejected_logps - batch.ref_rejected_logps.detach())


def plugins_with(**losses):
    """A fresh manager holding only the given losses: name=(fn, options)."""

    class Local:
        @hookimpl
        def register_losses(self, register):
            for name, (fn, options) in losses.items():
                register(f"dpo.{name}", fn, **{"consumes": PreferenceLogps, **options})

    return make_plugins(autoload=False, plugins=[Local()])


def violation_of(name: str, fn, **options) -> ContractViolation:
    with pytest.raises(ContractViolation) as caught:
        check_loss(f"dpo.{name}", plugins_with(**{name: (fn, options)}), max_examples=15)
    return caught.value


def naive_discopop(batch, p):
    # DiscoPOP as written in the paper: for z ≪ 0, m = σ(z/τ) underflows to 0 and exp(−z) overflows.
    z = p.beta * margin(batch)
    m = torch.sigmoid(z / 0.05)
    return (1 - m) * -F.logsigmoid(z) + m * torch.exp(-z)


def test_nan_at_large_margins_is_caught():
    violation = violation_of("naive_discopop", naive_discopop, params=Beta)
    assert violation.property == "finite output"
    message = str(violation)
    assert message.startswith("loss 'dpo.naive_discopop' violates 'finite output': returned [nan]")
    assert "on input: PreferenceLogps(" in message and "chosen_logps=torch.tensor([" in message
    # The input it names really breaks the loss: rebuild it from the message and rerun.
    batch = eval(violation.input, {"torch": torch, "PreferenceLogps": PreferenceLogps})
    assert torch.isnan(naive_discopop(batch, Beta())).any()
    assert batch.margin.abs().max() * 0.1 > 88  # exp overflows float32 beyond 88.7


@attrs.frozen
class RawPreferences:
    """A third party's batch class that, unlike plait.engine.batches, does not detach its reference."""

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor
    ref_rejected_logps: torch.Tensor


def leaky(batch, p):  # forms the log-ratios by hand and forgets that the reference is a constant
    chosen = batch.chosen_logps - batch.ref_chosen_logps
    rejected = batch.rejected_logps - batch.ref_rejected_logps
    return -F.logsigmoid(p.beta * (chosen - rejected))


def test_a_gradient_into_the_reference_is_caught():
    # The kit knows RawPreferences only from its fields: ref_* are the reference, the rest policy.
    violation = violation_of("leaky", leaky, params=Beta, consumes=RawPreferences)
    assert violation.property == "no gradient into the reference"
    assert "d loss / d ref_chosen_logps = [" in str(violation) and "on input: RawPreferences(" in str(violation)
    detached = lambda b, p: leaky(attrs.evolve(b, ref_chosen_logps=b.ref_chosen_logps.detach(),  # noqa: E731
                                               ref_rejected_logps=b.ref_rejected_logps.detach()), p)
    assert "no gradient into the reference" in check_loss(
        "dpo.fixed", plugins_with(fixed=(detached, {"params": Beta, "consumes": RawPreferences})), max_examples=15)


def test_plait_batches_keep_gradients_out_of_the_reference():
    # plait.engine.batches detaches reference log-probs itself, so no plait loss can leak into them.
    assert _reference_detached_by_batches()
    assert "no gradient into the reference" in check_loss("dpo.leaky", plugins_with(leaky=(leaky, {"params": Beta})),
                                                           max_examples=15)


def test_a_registered_batch_kind_is_used(monkeypatch):
    from plait.testing.strategies import BATCH_KINDS, BatchKind, preference_logps

    def raw(**kwargs):
        return preference_logps(**kwargs).map(lambda b: RawPreferences(
            b.chosen_logps, b.rejected_logps, b.ref_chosen_logps, b.ref_rejected_logps))

    monkeypatch.setitem(BATCH_KINDS, RawPreferences, BatchKind(
        RawPreferences, raw, policy=("chosen_logps", "rejected_logps"), reference=(),
        raise_margin=lambda b, d: attrs.evolve(b, chosen_logps=b.chosen_logps + d)))
    checked = check_loss("dpo.leaky", plugins_with(leaky=(leaky, {"params": Beta, "consumes": RawPreferences,
                                                                  "monotone": "non_increasing_in_margin"})),
                         max_examples=15)
    assert "no gradient into the reference" not in checked and "monotone: non_increasing_in_margin" in checked


@pytest.mark.parametrize("fn, options, prop", [
    (lambda b, p: -F.logsigmoid(margin(b)).detach(), {}, "gradient reaches the policy"),
    (lambda b, p: -F.logsigmoid(margin(b)).mean(), {}, "output shape"),
    (lambda b, p: -F.logsigmoid(margin(b))[None], {"output": "token"}, "declared input"),
    (lambda b, p: margin(b).abs().sqrt(), {}, "finite gradient"),  # d√x/dx = inf at a zero margin
    (lambda b, p: (10 * margin(b)) ** 2 * 1e-9, {}, "finite output (float16 inputs)"),
    (lambda b, p: -F.logsigmoid(margin(b) - margin(b).mean()), {}, "batch-mean independence"),
    (lambda b, p: -F.logsigmoid(margin(b) - margin(b)[0]), {"output": "scalar"}, "output shape"),
    (lambda b, p: -F.logsigmoid(margin(b))[0], {"output": "scalar"}, "permutation invariance"),
    (lambda b, p: margin(b).abs(), {"monotone": "non_increasing_in_margin"}, "monotone: non_increasing_in_margin"),
    (lambda b, p: b.no_such_field, {}, "finite output"),
])
def test_broken_losses_are_caught_by_the_right_property(fn, options, prop):
    violation = violation_of("broken", fn, **options)
    assert violation.property == prop, str(violation)
    assert str(violation).startswith(f"loss 'dpo.broken' violates '{prop}': ")


def test_an_unknown_monotonicity_is_refused_when_the_loss_registers():
    with pytest.raises(PlaitError, match=r"option 'monotone' must be in \('non_increasing_in_margin',\)"):
        plugins_with(broken=(lambda b, p: -F.logsigmoid(margin(b)), {"monotone": "increasing"})).losses


def test_a_raising_loss_names_the_exception():
    assert "raised AttributeError" in str(violation_of("broken", lambda b, p: b.no_such_field))


def test_a_loss_must_declare_its_batch():
    class Undeclared:
        @hookimpl
        def register_losses(self, register):
            register("dpo.undeclared", lambda b, p: -F.logsigmoid(margin(b)))

    with pytest.raises(ContractViolation, match="declared input.*consumes="):
        check_loss("dpo.undeclared", make_plugins(autoload=False, plugins=[Undeclared()]))


def test_the_scalar_and_coupled_declarations_relax_the_right_properties():
    def scalar(b, p):
        return -F.logsigmoid(margin(b)).mean()

    def centred(b, p):  # couples examples through the batch mean, and says so
        return -F.logsigmoid(margin(b) - margin(b).mean())

    checked = check_loss("dpo.scalar", plugins_with(scalar=(scalar, {"output": "scalar"})))
    assert "batch-mean independence" not in checked and "permutation invariance" in checked
    checked = check_loss("dpo.centred", plugins_with(centred=(centred, {"batch_coupled": True})))
    assert "permutation invariance" not in checked and "finite output (bfloat16 inputs)" in checked


def test_token_losses_must_ignore_masked_tokens():
    def whole_row_mean(batch, p):  # averages over padding too
        return -batch.logps.mean(-1)

    class Tokens:
        @hookimpl
        def register_losses(self, register):
            register("sft.row_mean", whole_row_mean, consumes=TokenLogps)
            register("sft.token_nll", lambda b, p: -b.logps, consumes=TokenLogps, output="token",
                     monotone="non_increasing_in_margin")

    plugins = make_plugins(autoload=False, plugins=[Tokens()])
    with pytest.raises(ContractViolation, match="'masked tokens ignored'"):
        check_loss("sft.row_mean", plugins)
    assert "masked tokens ignored" in check_loss("sft.token_nll", plugins)


def test_params_must_be_validated():
    @attrs.frozen
    class Unchecked:
        beta: float = 0.1

    @attrs.frozen
    class TypeOnly:
        beta: float = attrs.field(default=0.1, validator=attrs.validators.instance_of(float))

    @attrs.frozen
    class Good:
        beta: float = attrs.field(default=0.1, validator=positive)
        mode: str = attrs.field(default="a", validator=attrs.validators.in_(["a", "b"]))
        normalise: bool = True

    fn = lambda b, p: -F.logsigmoid(p.beta * margin(b))  # noqa: E731
    assert "no validator" in str(violation_of("loose", fn, params=Unchecked))
    assert "beta=nan passes its validator" in str(violation_of("loose", fn, params=TypeOnly))
    assert "parameters validated" in check_loss("dpo.good", plugins_with(good=(fn, {"params": Good})))


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------


def length_reward(completions, **kwargs):
    return [float(len(c)) if c else None for c in completions]


async def async_length_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return length_reward(completions)


def needs_solution(completions, solution, **kwargs):
    return [1.0 if c.strip() == s.strip() else 0.0 for c, s in zip(completions, solution)]


def scaled(completions, scale, **kwargs):
    return [scale * len(c) for c in completions]


@attrs.frozen
class Scale:
    scale: float = attrs.field(default=2.0, validator=positive)


def reward_plugins(**rewards):
    class Local:
        @hookimpl
        def register_rewards(self, register):
            for name, (obj, options) in rewards.items():
                register(f"reward.{name}", obj, **options)

    return make_plugins(autoload=False, plugins=[Local()])


def check_local_reward(obj, **options):
    return check_reward("reward.local", reward_plugins(local=(obj, options)), max_examples=15)


def test_good_rewards_pass():
    assert "picklable" in check_local_reward(length_reward)
    assert "picklable" in check_local_reward(async_length_reward)
    assert "picklable" in check_local_reward(needs_solution)  # the solution column is supplied
    factory = lambda p: functools.partial(scaled, scale=p.scale)  # noqa: E731 - a factory may be a lambda
    assert "parameters validated" in check_local_reward(factory, params=Scale)


def conversational(completions, **kwargs):
    return [float(len(c[-1]["content"])) for c in completions]


def one_too_many(completions, **kwargs):
    return [1.0] * (len(completions) + 1)


def nan_for_unknown(completions, **kwargs):
    return [math.nan] * len(completions)


def labels(completions, **kwargs):
    return ["good"] * len(completions)


def no_kwargs(completions):
    return [0.0] * len(completions)


@pytest.mark.parametrize("obj, options, prop, detail", [
    (one_too_many, {}, "one value or None per completion", "for"),
    (nan_for_unknown, {}, "one value or None per completion", "neither a finite number nor None"),
    (labels, {}, "one value or None per completion", "neither a finite number nor None"),
    (no_kwargs, {}, "accepts **kwargs", "**kwargs"),
    (lambda completions, **kw: [0.0] * len(completions), {}, "picklable", "closure or lambda"),
    (conversational, {}, "one value or None per completion", "raised"),  # text completions, read as messages
])
def test_broken_rewards_are_caught(obj, options, prop, detail):
    with pytest.raises(ContractViolation) as caught:
        check_local_reward(obj, **options)
    assert caught.value.property == prop and detail in str(caught.value), str(caught.value)


def test_a_reward_declares_the_completion_format_it_reads():
    assert "picklable" in check_local_reward(conversational, completion_format="messages")


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------


def group_zscore(rollout: Rollout, params) -> torch.Tensor:
    """GRPO's estimator: (R − mean)/(std + 1e-4) per group over scored rows; unscored rows get 0."""
    reward = rollout.total_reward.view(-1, rollout.group_size)
    valid = ~reward.isnan()
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    mean = reward.nan_to_num().sum(-1, keepdim=True) / count
    centred = torch.where(valid, reward - mean, 0.0)
    std = (centred.square().sum(-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    return (centred / (std + 1e-4)).view(-1)


def strided_mean(rollout: Rollout, params) -> torch.Tensor:
    # The classic bug: view(G, -1) groups rows by stride instead of consecutively.
    reward = rollout.total_reward.view(rollout.group_size, -1)
    valid = ~reward.isnan()
    mean = reward.nan_to_num().sum(0) / valid.sum(0).clamp(min=1)
    return torch.where(valid, reward - mean, 0.0).view(-1)


def reinforce(rollout: Rollout, params) -> torch.Tensor:
    return rollout.total_reward.nan_to_num()


def above_minimum(rollout: Rollout, params) -> torch.Tensor:
    reward = rollout.total_reward.view(-1, rollout.group_size)
    lowest = reward.nan_to_num(math.inf).min(-1, keepdim=True).values
    return torch.where(reward.isnan(), 0.0, reward - lowest).view(-1)


def naive_zscore(rollout: Rollout, params) -> torch.Tensor:
    reward = rollout.total_reward.view(-1, rollout.group_size)  # NaN for None leaks through
    return ((reward - reward.mean(-1, keepdim=True)) / (reward.std(-1, keepdim=True) + 1e-4)).view(-1)


def td_residual(rollout: Rollout, params) -> torch.Tensor:
    return (rollout.token_rewards - rollout.values) * rollout.mask


def estimator_plugins(**estimators):
    class Local:
        @hookimpl
        def register_advantage_estimators(self, register):
            for name, (fn, options) in estimators.items():
                register(f"advantage.{name}", fn, **options)

    return make_plugins(autoload=False, plugins=[Local()])


def check_local_estimator(fn, **options):
    return check_advantage_estimator("advantage.local", estimator_plugins(local=(fn, options)), max_examples=15)


def test_good_estimators_pass():
    assert "zero mean per group" in check_local_estimator(group_zscore, zero_mean_per_group=True)
    assert "all-equal group → zeros" not in check_local_estimator(reinforce, group_relative=False)
    assert check_local_estimator(td_residual, token_level=True)[-1] == "permutation equivariance"


@pytest.mark.parametrize("fn, options, prop", [
    (strided_mean, {}, "permutation equivariance"),
    (naive_zscore, {}, "finite advantages"),
    (reinforce, {}, "all-equal group → zeros"),
    (above_minimum, {"zero_mean_per_group": True}, "zero mean per group"),
    (lambda r, p: reinforce(r, p)[:, None], {"group_relative": False}, "shape preserved"),
    (reinforce, {"token_level": True}, "shape preserved"),
])
def test_broken_estimators_are_caught(fn, options, prop):
    with pytest.raises(ContractViolation) as caught:
        check_local_estimator(fn, **options)
    assert caught.value.property == prop, str(caught.value)
    assert "on input: Rollout(" in str(caught.value)


# ---------------------------------------------------------------------------------------------
# The strategies draw what they promise
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]).flatmap(
    lambda dtype: st.tuples(st.just(dtype), preference_logps(dtype=dtype))))
def test_preference_batches_are_realistic(drawn):
    dtype, batch = drawn
    for name in ("chosen", "rejected"):
        logps, ref, lengths = (getattr(batch, f) for f in (f"{name}_logps", f"ref_{name}_logps", f"{name}_lengths"))
        assert logps.dtype == ref.dtype == lengths.dtype == dtype and logps.shape == (batch.batch_size,)
        assert (logps <= 0).all() and (ref <= 0).all() and torch.isfinite(logps).all()
        assert (lengths >= 0).all() and (lengths == lengths.round()).all()
        assert (logps[lengths == 0] == 0).all() and (ref[lengths == 0] == 0).all()  # empty completions


def test_strategies_reach_huge_margins_and_empty_completions():
    seen = {"huge": False, "empty": False, "equal": False}

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(preference_logps())
    def observe(batch):
        seen["huge"] |= bool((batch.margin.abs() > 1e4).any())
        seen["empty"] |= bool((batch.chosen_lengths == 0).any())
        seen["equal"] |= bool((batch.chosen_logratios == 0).any())

    observe()
    assert all(seen.values()), seen


@settings(max_examples=40, deadline=None)
@given(unpaired_logps(), token_logps())
def test_unpaired_and_token_batches(unpaired, tokens):
    assert unpaired.kl_logratio.dim() == 0 and unpaired.kl_logratio >= 0 and unpaired.desirable.dtype == torch.bool
    assert tokens.logps.shape == tokens.mask.shape and tokens.mask.any() and (tokens.logps <= 0).all()


@settings(max_examples=40, deadline=None)
@given(rollouts(all_equal=True, token_level=True))
def test_rollouts_group_rows_consecutively(rollout):
    n, k = rollout.rewards.shape
    assert n % rollout.group_size == 0 and rollout.weights.shape == (k,) and rollout.group_size >= 2
    assert rollout.values.shape == rollout.token_rewards.shape == rollout.mask.shape and rollout.mask[:, 0].all()
    totals = rollout.total_reward.view(-1, rollout.group_size)
    scored = totals[~totals.isnan()]
    for group in totals:
        group = group[~group.isnan()]
        assert (group == group[0]).all() if len(group) else True
    assert scored.isfinite().all()


def test_take_slices_examples_and_keeps_batch_statistics():
    batch = UnpairedLogps(torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5, -2.5, -3.5]),
                          torch.tensor([True, False, True]), torch.tensor(0.25))
    part = take(batch, [2, 0])
    assert part.logps.tolist() == [-3.0, -1.0] and part.desirable.tolist() == [True, True]
    assert part.kl_logratio.item() == 0.25


def test_describe_writes_an_input_back_as_code():
    batch = TokenLogps(torch.tensor([[-0.5, -1.25]]), torch.tensor([[True, False]]))
    text = describe(batch)
    assert text == ("TokenLogps(logps=torch.tensor([[-0.5, -1.25]], dtype=torch.float32), "
                    "mask=torch.tensor([[True, False]], dtype=torch.bool))")
    again = eval(text, {"torch": torch, "TokenLogps": TokenLogps})
    assert torch.equal(again.logps, batch.logps) and torch.equal(again.mask, batch.mask)
