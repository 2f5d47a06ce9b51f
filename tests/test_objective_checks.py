"""A loss plugin that returns the wrong thing for its declared ``output=`` is named, with its
distribution, the first time it runs; an installed plugin on sys.path, real registered losses."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from plait import hookimpl, make_plugins
from plait.engine.batches import PolicyTokens, PreferenceLogps, TokenLogps, UnpairedLogps
from plait.engine.objective import Objective, normalise_loss_specs
from plait.errors import PlaitError

PLUGIN = '''
import torch
import plait
from plait.engine.batches import PolicyTokens, PreferenceLogps, TokenLogps, UnpairedLogps


def per_example(batch, p):
    return -torch.nn.functional.logsigmoid(batch.margin)


def column(batch, p):  # [B, 1] where [B] is declared: would be broadcast and silently averaged
    return per_example(batch, p).unsqueeze(-1)


def number(batch, p):
    return per_example(batch, p).mean().item()


def detached(batch, p):
    return per_example(batch, p).detach()


def nan(batch, p):
    return per_example(batch, p) * float("nan")


def row_sums(batch, p):  # [B] where output="token" declares [B, T]
    return -(batch.logps * batch.mask).sum(-1)


def token_nll(batch, p):
    return -batch.logps


def policy_rows(batch, p):  # [B] where output="scalar" declares a 0-dim tensor
    return -(batch.logps * batch.token_advantages * batch.mask).sum(-1)


def policy_mean(batch, p):
    return -(batch.logps * batch.token_advantages * batch.mask).sum() / batch.mask.sum()


@plait.hookimpl
def register_losses(register):
    register("dpo.per_example", per_example, consumes=PreferenceLogps)
    register("dpo.column", column, consumes=PreferenceLogps)
    register("dpo.number", number, consumes=PreferenceLogps)
    register("dpo.detached", detached, consumes=PreferenceLogps)
    register("dpo.nan", nan, consumes=PreferenceLogps)
    register("sft.row_sums", row_sums, consumes=TokenLogps, output="token")
    register("sft.token_nll", token_nll, consumes=TokenLogps, output="token")
    register("grpo.policy_rows", policy_rows, consumes=PolicyTokens, output="scalar")
    register("grpo.policy_mean", policy_mean, consumes=PolicyTokens, reduces=True)  # the older spelling of scalar
'''


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """Every installed plugin plus ``broken-losses 0.1``, installed on sys.path as pip would leave it."""
    site = tmp_path_factory.mktemp("site")
    files = {
        "broken_losses.py": PLUGIN,
        "broken_losses-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: broken-losses\nVersion: 0.1\n",
        "broken_losses-0.1.dist-info/entry_points.txt": "[plait]\nbroken_losses = broken_losses\n",
    }
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(textwrap.dedent(text))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(site))
        yield make_plugins()


B, T = 4, 5


def preference_batch() -> PreferenceLogps:
    chosen, rejected = torch.randn(B, requires_grad=True), torch.randn(B, requires_grad=True)
    return PreferenceLogps(chosen, rejected, torch.randn(B), torch.randn(B), torch.full((B,), 3.0), torch.full((B,), 3.0))


def token_batch() -> TokenLogps:
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :2] = False
    return TokenLogps(-torch.rand(B, T, requires_grad=True), mask)


def policy_batch() -> PolicyTokens:
    logps = -torch.rand(B, T, requires_grad=True)
    return PolicyTokens(logps=logps, old_logps=logps.detach(), advantages=torch.randn(B), mask=torch.ones(B, T))


FAMILIES = {"dpo": (PreferenceLogps, preference_batch), "sft": (TokenLogps, token_batch),
            "grpo": (PolicyTokens, policy_batch)}


def objective(plugins, *names: str) -> tuple[Objective, object]:
    family = names[0].split(".")[0]
    consumes, batch = FAMILIES[family]
    built = Objective.build(normalise_loss_specs(list(names)), plugins.losses, family=family, consumes=consumes)
    return built, batch()


def call(built: Objective, batch):
    mask = getattr(batch, "mask", None)
    return built(batch, mask=mask) if isinstance(batch, TokenLogps) else built(batch)


@pytest.mark.parametrize("name, phrase", [
    ("dpo.column", "declares output='example' and must return [B] (one value per example), shape (4,), but returned "
                   "shape (4, 1)"),
    ("dpo.number", "declares output='example' but returned a float, not a tensor"),
    ("dpo.detached", "returned a tensor without gradient"),
    ("sft.row_sums", "declares output='token' and must return [B, T] like the mask, shape (4, 5), but returned shape (4,)"),
    ("grpo.policy_rows", "declares output='scalar' and must return a 0-dim tensor, shape (), but returned shape (4,)"),
])
def test_a_wrong_output_names_the_loss_its_plugin_and_distribution(plugins, name, phrase):
    built, batch = objective(plugins, name)
    with pytest.raises(PlaitError) as err:
        call(built, batch)
    message = str(err.value)
    assert phrase in message
    assert f"loss {name!r} (plugin broken_losses, distribution broken-losses 0.1)" in message
    assert "\n" not in message


@pytest.mark.parametrize("names", [("dpo.per_example", "dpo.sigmoid"), ("sft.token_nll", "sft.nll"),
                                   ("grpo.policy_mean", "grpo.dapo")])
def test_right_outputs_pass_and_compose(plugins, names):
    built, batch = objective(plugins, *names)
    total, parts = call(built, batch)
    assert total.dim() == 0 and total.requires_grad and set(parts) == set(names)
    assert torch.isfinite(total)


def test_a_loss_without_gradient_is_fine_where_nothing_trains(plugins):
    built, batch = objective(plugins, "dpo.detached")
    with torch.no_grad():  # evaluation
        total, _ = call(built, batch)
    assert total.shape == ()


def test_an_unknown_output_is_refused_when_the_loss_registers():
    # the loss kind's typed options (plait.hookspecs.LossOptions) refuse it before any objective is built
    class Typo:
        @hookimpl
        def register_losses(self, register):
            register("dpo.typo", lambda batch, p: -batch.chosen_logps, consumes=PreferenceLogps, output="examples")

    plugins = make_plugins(autoload=False)
    plugins.register(Typo(), name="typo")
    with pytest.raises(PlaitError, match=r"loss 'dpo.typo' from plugin 'typo' \(not installed\): option 'output' "
                                         r"must be in \('example', 'token', 'scalar'\) \(got 'examples'\)"):
        plugins.losses


def test_the_objective_names_the_part_that_went_nonfinite(plugins):
    built, batch = objective(plugins, "dpo.sigmoid", "dpo.nan")
    total, parts = call(built, batch)
    assert not torch.isfinite(total) and torch.isfinite(parts["dpo.sigmoid"])
    assert [t.name for t in built.nonfinite_terms()] == ["dpo.nan"]
    built.reset_watch()
    assert built.nonfinite_terms() == []


def test_metrics_are_the_mean_of_each_value_and_each_part_by_name(plugins):
    built = Objective.build(normalise_loss_specs(["dpo.sigmoid", "dpo.per_example"]), plugins.losses, family="dpo",
                            consumes=PreferenceLogps, metrics=lambda batch: batch.reward_metrics(0.5))
    batch = preference_batch()
    loss, parts = built(batch)
    logged = built.metrics(batch, parts)
    chosen, rejected = 0.5 * batch.chosen_logratios.detach(), 0.5 * batch.rejected_logratios.detach()
    assert set(logged) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                           "logps/chosen", "logps/rejected", "loss/dpo.sigmoid", "loss/dpo.per_example"}
    assert logged["rewards/margins"] == (chosen - rejected).mean()
    assert logged["rewards/accuracies"] == (chosen > rejected).float().mean()
    assert logged["logps/rejected"] == batch.rejected_logps.detach().mean()
    assert logged["loss/dpo.per_example"] == parts["dpo.per_example"]
    assert not any(value.requires_grad for value in logged.values())
    assert "loss/dpo.sigmoid" not in objective(plugins, "dpo.sigmoid")[0].metrics(batch, {"dpo.sigmoid": loss})


def test_kto_metrics_of_a_batch_with_one_class_are_nan_for_the_other():
    logps, ref = torch.tensor([-3.0, -4.5]), torch.tensor([-4.0, -4.0])
    batch = UnpairedLogps(logps, ref, torch.tensor([True, True]), torch.tensor(0.25))
    metrics = batch.reward_metrics(0.1)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.025) and metrics["logps/chosen"].item() == -3.75
    assert metrics["rewards/rejected"].isnan() and metrics["rewards/margins"].isnan()
    assert metrics["logps/rejected"].isnan() and metrics["kl"].item() == 0.25
