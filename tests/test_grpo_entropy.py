"""GRPO's entropy and masking fields (TRL 1.16): values computed by hand on fixed examples.

* token entropies come out of the chunked log-prob path (no [B, T, V] logits) and equal the
  closed form of a known distribution, with the closed-form gradient;
* ``entropy_coef`` c adds ``grpo.entropy_bonus``: the loss moves by exactly −c·H̄;
* ``use_adaptive_entropy``: the coefficient steps by Δ toward the target, clamps, applies only at
  or below the target, and survives a checkpoint resume;
* ``top_entropy_quantile``, ``off_policy_mask_threshold``: exactly the tokens / sequences TRL's
  rule drops are dropped, normalisers unchanged;
* ``cast_lm_head_to_fp32``: under a bf16 autocast the output layer runs in float32.
"""

import math

import pytest
import torch
from test_grpo_losses import MASK, losses  # noqa: F401  (losses: the registry fixture)
from test_grpo_losses import batch as losses_batch
from test_grpo_losses import loss as losses_loss
from test_resume import StopAt, assert_same_run, low_tokens, prompts
from transformers import AutoModelForCausalLM

import plait
from plait.engine.batches import PolicyTokens
from plait.engine.logprobs import token_logprobs
from plait.engine.objective import Objective
from plait.errors import PlaitError
from plait.testing.tiny_model import tiny_model_path

# test_grpo_losses's batch, whose clipped surrogate −min(ρA, clip(ρ, 0.8, 1.2)A) is row 0: [−1.2, −0.9],
# row 1: [0.8, 1.1, 3.0] on the counted tokens, with token entropies: 0.1, 2.0 | 0.5, 1.0, 3.0 counted,
# the padding's (9.0) never counts
ENTROPY = [[0.1, 2.0, 9.0, 9.0], [0.5, 1.0, 3.0, 9.0]]


def batch(**overrides) -> PolicyTokens:
    return losses_batch(**{"entropy": torch.tensor(ENTROPY, requires_grad=True), **overrides})


def loss(losses, name, data=None, **params):
    return losses_loss(losses, name, data if data is not None else batch(), **params)


# -- entropies through the chunked path ------------------------------------------------------------


def model_predicting(logits: torch.Tensor):
    """The tiny model with an output layer that predicts ``logits`` at every position (weight 0, bias)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    head = torch.nn.Linear(model.config.hidden_size, logits.numel(), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(logits)
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


def test_chunked_entropy_of_a_known_distribution_is_the_closed_form():
    vocab = AutoModelForCausalLM.from_pretrained(tiny_model_path()).config.vocab_size
    # p = (1/2, 1/4, then 1/4 spread evenly over the other V − 2 tokens)
    p = torch.cat([torch.tensor([0.5, 0.25]), torch.full((vocab - 2,), 0.25 / (vocab - 2))]).double()
    model = model_predicting(p.log().float())
    ids = torch.tensor([[3, 0, 1, 7, 1, 0]])
    entropy = 0.5 * math.log(2) + 0.25 * math.log(4) + 0.25 * math.log(4 * (vocab - 2))
    # temperature 2: q ∝ p^(1/2)
    q = p.sqrt() / p.sqrt().sum()
    tempered = -(q * q.log()).sum().item()
    for temperature, expected, probs in ((1.0, entropy, p), (2.0, tempered, q)):
        for chunked in (True, False):
            out = token_logprobs(model, ids, temperature=temperature, with_entropy=True, chunk_size=2,
                                 chunked=chunked)
            assert out.entropy[0, 1:].tolist() == pytest.approx([expected] * 5, rel=1e-5)
            assert out.logps[0, 1:].tolist() == pytest.approx(probs[ids[0, 1:]].log().tolist(), rel=1e-5)
            assert out.entropy[0, 0] == 0  # nothing predicts the first token

    # the bonus's gradient through the chunks: dH/dz_v = −p_v (log p_v + H), at each of the 5 positions
    model.zero_grad()
    token_logprobs(model, ids, with_entropy=True, chunk_size=2).entropy.sum().backward()
    expected_grad = -5 * p * (p.log() + entropy)
    torch.testing.assert_close(model.lm_head.bias.grad.double(), expected_grad, rtol=1e-4, atol=1e-7)


# -- the entropy bonus ----------------------------------------------------------------------------


def objective(losses, *specs):
    return Objective.build(list(specs), losses, family="grpo", consumes=PolicyTokens)


def test_entropy_bonus_moves_the_loss_by_minus_coef_times_mean_entropy(losses):
    mean = (0.1 + 2.0 + 0.5 + 1.0 + 3.0) / 5  # 1.32: padding ignored
    plain, _ = objective(losses, {"name": "bnpo"})(batch())
    total, parts = objective(losses, {"name": "bnpo"}, {"name": "entropy_bonus", "weight": 0.01})(batch())
    assert plain.item() == pytest.approx(2.8 / 5, rel=1e-6)
    assert (total - plain).item() == pytest.approx(-0.01 * mean, rel=1e-5)
    assert parts["grpo.entropy_bonus"].item() == pytest.approx(-mean, rel=1e-6)
    # scaled for gradient accumulation only, never by the policy loss's normaliser
    assert loss(losses, "grpo.entropy_bonus", batch(gradient_accumulation_steps=4, num_items_in_batch=50)).item() \
        == pytest.approx(-mean / 4, rel=1e-6)
    data = batch()
    (0.01 * loss(losses, "grpo.entropy_bonus", data)).backward()  # the gradient raises counted entropies only
    assert torch.allclose(data.entropy.grad, -0.01 * torch.tensor(MASK) / 5)


def test_entropy_coef_composes_the_bonus_with_any_loss_type():
    specs = plait.GRPOConfig(output_dir="/tmp/x", loss_type="grpo", entropy_coef=0.01).params.loss_specs()
    assert specs == [{"name": "grpo"}, {"name": "grpo.entropy_bonus", "weight": 0.01}]
    assert plait.GRPOConfig(output_dir="/tmp/x").params.loss_specs() == [{"name": "dapo"}]  # 0: no term at all
    adaptive = plait.GRPOConfig(output_dir="/tmp/x", use_adaptive_entropy=True).params.loss_specs()
    assert adaptive[-1] == {"name": "grpo.adaptive_entropy_bonus"}


def test_the_trainer_adds_minus_coef_times_the_models_mean_entropy():
    """Through GRPOTrainer.compute_loss on the tiny model: the entropies are the chunked path's."""
    from test_grpo import config

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 900, (4, 9), generator=generator)
    completion_mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] * 2 + [0] * 4])
    inputs = {"input_ids": ids, "attention_mask": torch.cat([torch.ones(4, 3, dtype=torch.long), completion_mask], 1),
              "completion_mask": completion_mask, "prompt_length": 3,
              "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8]),
              "num_items_in_batch": completion_mask.sum().float()}
    values = {}
    for coef in (0.0, 0.05):
        t = plait.GRPOTrainer(model, reward_funcs=low_tokens, args=config(entropy_coef=coef, max_completion_length=6),
                              train_dataset=[{"prompt": "a"}] * 8)
        t.current_gradient_accumulation_steps = 1
        values[coef] = t.compute_loss(t.model, dict(inputs)).item()
    entropy = token_logprobs(model, ids, inputs["attention_mask"], with_entropy=True).entropy[:, 3:]
    mean = ((entropy * completion_mask).sum() / completion_mask.sum()).item()
    assert values[0.05] - values[0.0] == pytest.approx(-0.05 * mean, rel=1e-4)


# -- adaptive entropy control ---------------------------------------------------------------------


def micro_batch(entropies: list[float]) -> PolicyTokens:
    n = len(entropies)
    logps = torch.zeros(1, n, requires_grad=True)
    return PolicyTokens(logps=logps, old_logps=logps.detach(), advantages=torch.zeros(1),
                        mask=torch.ones(1, n, dtype=torch.bool), entropy=torch.tensor([entropies], requires_grad=True))


def test_adaptive_coefficient_steps_toward_the_target_and_clamps(losses):
    component = losses.get("grpo.adaptive_entropy_bonus")
    p = component.make_params(entropy_coef=0.1, entropy_target=1.0, entropy_coef_delta=0.05, entropy_coef_max=0.18)

    def step(*micro_batches):
        values = [component.obj(micro_batch(m), p).item() for m in micro_batches]
        return values, p.end_optimizer_step(lambda stats: stats)["entropy_coef"]

    # step 1: no entropy measured yet (Ĥ = ∞ > target): no bonus; Ĥ = 0.8 ≤ 1.0 -> c = 0.1 + 0.05
    values, coef = step([0.6, 1.0])
    assert values == [0.0] and coef == pytest.approx(0.15)
    # step 2: Ĥ was 0.8 ≤ target, so the bonus applies with c = 0.15: −0.15·0.8; c = min(0.20, 0.18)
    values, coef = step([0.8, 0.8])
    assert values == [pytest.approx(-0.15 * 0.8)] and coef == pytest.approx(0.18)
    # step 3: two micro-batches, Ĥ token-weighted over both: (2·0.5 + 3·1.5) / 5 = 1.1 > 1.0 (the mean of
    # the two means would be 1.0 ≤ 1.0): c = 0.18 − 0.05
    values, coef = step([0.5, 0.5], [1.5, 1.5, 1.5])
    assert values == [pytest.approx(-0.18 * 0.5), pytest.approx(-0.18 * 1.5)] and coef == pytest.approx(0.13)
    # step 4: Ĥ = 1.1 > target: no bonus although c = 0.13; 2.0 > 1.0 again -> 0.08, then 0.03, then 0 (the floor)
    values, coef = step([2.0])
    assert values == [0.0] and coef == pytest.approx(0.08)
    assert [step([2.0])[1], step([2.0])[1]] == [pytest.approx(0.03), 0.0]
    # evaluation (no gradient) never moves the controller
    with torch.no_grad():
        component.obj(micro_batch([0.1]), p)
    assert p.controller.window is None and p.end_optimizer_step(lambda stats: stats)["entropy_coef"] == 0.0


def test_adaptive_bonus_parameters_are_checked(losses):
    with pytest.raises(PlaitError, match="entropy_coef_min=0.5 is above entropy_coef_max=0.2"):
        losses.get("grpo.adaptive_entropy_bonus").make_params(entropy_coef_min=0.5, entropy_coef_max=0.2)
    with pytest.raises(PlaitError, match="entropy_coef_delta=-0.1 must be a number >= 0"):
        plait.GRPOConfig(output_dir="/tmp/x", entropy_coef_delta=-0.1)
    with pytest.raises(PlaitError, match=r"top_entropy_quantile=1.5 must be in \[0.0, 1.0\]"):
        plait.GRPOConfig(output_dir="/tmp/x", top_entropy_quantile=1.5)


def test_adaptive_coefficient_survives_a_checkpoint_resume(tmp_path):
    """Trained 4 steps straight, and cut after step 2 then resumed by a fresh trainer: the same
    coefficient every step (it rises each step: the tiny model's entropy is below the target 100)."""
    def build(output):
        args = plait.GRPOConfig(output_dir=str(output), learning_rate=1e-2, max_steps=4, save_strategy="steps",
                                save_steps=2, logging_steps=1, report_to="none", disable_tqdm=True, seed=0,
                                per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                                use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=100.0,
                                entropy_coef_delta=0.02)
        return plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args, train_dataset=prompts(8))

    build(tmp_path / "straight").train()
    cut = build(tmp_path / "cut")
    cut.add_callback(StopAt(2))
    cut.train()
    resumed = build(tmp_path / "cut")
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    assert_same_run(tmp_path / "straight" / "checkpoint-4", tmp_path / "cut" / "checkpoint-4", "grpo adaptive entropy",
                    ("entropy_coef",))
    assert resumed.objective.terms[-1].params.controller.coef == pytest.approx(0.01 + 4 * 0.02)


# -- top_entropy_quantile ---------------------------------------------------------------------------


def test_top_entropy_quantile_keeps_the_policy_term_of_the_high_entropy_tokens_only(losses):
    # counted entropies 0.1, 2.0, 0.5, 1.0, 3.0: the 0.5 quantile is 1.0; kept: 2.0, 1.0, 3.0 (row 0's −0.9,
    # row 1's 1.1 and 3.0); the normaliser still counts all 5 tokens
    assert loss(losses, "grpo.bnpo", top_entropy_quantile=0.5).item() == pytest.approx((-0.9 + 1.1 + 3.0) / 5, rel=1e-5)
    # ρ = 0: only the highest-entropy token (3.0); ρ = 1: every token
    assert loss(losses, "grpo.bnpo", top_entropy_quantile=0.0).item() == pytest.approx(3.0 / 5, rel=1e-5)
    assert loss(losses, "grpo.bnpo", top_entropy_quantile=1.0).item() == pytest.approx(2.8 / 5, rel=1e-5)
    # the bonus acts on the same tokens: mean(2.0, 1.0, 3.0)
    assert loss(losses, "grpo.entropy_bonus", top_entropy_quantile=0.5).item() == pytest.approx(-2.0, rel=1e-6)


def test_top_entropy_half_of_an_even_count_is_exactly_the_high_half():
    from plait.losses._grpo import high_entropy_tokens

    data = batch(mask=torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]).bool())  # counted: 0.1, 2.0 | 0.5, 3.0
    kept = high_entropy_tokens(data, 0.5)  # the cut interpolates to 1.25
    assert kept.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]


def test_the_quantile_spans_every_process():
    from plait.losses._grpo import high_entropy_tokens

    # another process's tokens (entropies 5, 6, 7) join this one's: the 0.5 quantile of
    # 0.1, 2.0, 0.5, 1.0, 3.0, 5, 6, 7 is 2.5, so only 3.0 is kept here
    data = batch(gather=lambda local: torch.cat([local, torch.tensor([5.0, 6.0, 7.0])]))
    assert high_entropy_tokens(data, 0.5).tolist() == [[0, 0, 0, 0], [0, 0, 1, 0]]


# -- off_policy_mask_threshold ----------------------------------------------------------------------


def drifted(advantages, drift, **overrides) -> PolicyTokens:
    """Two tokens per row with log π = −1 and log π_old = −1 + drift (drift = log π_old − log π)."""
    logps = torch.full((3, 2), -1.0, requires_grad=True)
    old = (logps + torch.tensor(drift).unsqueeze(-1)).detach()
    return PolicyTokens(logps=logps, old_logps=old, advantages=torch.tensor(advantages), mask=torch.ones(3, 2),
                        **overrides)


def test_off_policy_mask_drops_negative_advantage_sequences_that_drifted(losses):
    # ρ = e^(−drift): row 0 (A = −1, drift 0.3) clips to 0.8 -> 0.8 per token; row 1 (A = −1, drift 0.1)
    # ρ = 0.904837; row 2 (A = +1, drift 0.5) ρ = 0.606531 -> −0.606531
    data = drifted([-1.0, -1.0, 1.0], [0.3, 0.1, 0.5])
    row0, row1, row2 = 0.8, math.exp(-0.1), -math.exp(-0.5)
    assert loss(losses, "grpo.bnpo", data).item() == pytest.approx(2 * (row0 + row1 + row2) / 6, rel=1e-5)
    # δ = 0.2: row 0 drifted 0.3 > δ with A < 0: dropped; row 2 drifted more but A ≥ 0: kept
    assert loss(losses, "grpo.bnpo", data, off_policy_mask_threshold=0.2).item() == \
        pytest.approx(2 * (row1 + row2) / 6, rel=1e-5)
    # δ = 0.05 drops row 1 too; δ = 0.31 keeps everything (drift ≤ δ)
    assert loss(losses, "grpo.bnpo", data, off_policy_mask_threshold=0.05).item() == \
        pytest.approx(2 * row2 / 6, rel=1e-5)
    assert loss(losses, "grpo.bnpo", data, off_policy_mask_threshold=0.31).item() == \
        pytest.approx(2 * (row0 + row1 + row2) / 6, rel=1e-5)


def test_off_policy_mask_reads_the_samplers_own_log_probs_when_given(losses):
    from plait.losses._grpo import off_policy_kept

    # the sampler saw row 1 at −0.5 (drift 0.5 > 0.2: dropped) and could not score row 0's tokens (NaN: drift 0)
    sampler = torch.tensor([[float("nan"), float("nan")], [-0.5, -0.5], [-1.0, -1.0]])
    data = drifted([-1.0, -1.0, 1.0], [0.3, 0.1, 0.5], sampling_logps=sampler)
    assert off_policy_kept(data, 0.2).squeeze(-1).tolist() == [1.0, 0.0, 1.0]


# -- cast_lm_head_to_fp32 ------------------------------------------------------------------------------


def test_cast_lm_head_to_fp32_projects_in_float32_under_bf16_autocast():
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval()
    ids = torch.randint(5, 900, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32 = token_logprobs(model, ids, with_entropy=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = token_logprobs(model, ids, with_entropy=True)
            cast = token_logprobs(model, ids, with_entropy=True, cast_lm_head_to_fp32=True)
            full = token_logprobs(model, ids, with_entropy=True, cast_lm_head_to_fp32=True, chunked=False)
            hidden = []
            handle = model.lm_head.register_forward_pre_hook(lambda module, args: hidden.append(args[0]))
            model(input_ids=ids)
            handle.remove()
    # exactly the float32 projection of the hidden states the bf16 body produced, chunked or not
    by_hand = torch.nn.functional.linear(hidden[0].float(), model.lm_head.weight.float()).log_softmax(-1)
    torch.testing.assert_close(cast.logps[:, 1:], by_hand[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1))
    torch.testing.assert_close(full.logps, cast.logps)
    # closer to the fp32 model than the bf16 projection (the body's bf16 error remains in both)
    error = {name: (out.logps - fp32.logps).abs().mean().item() for name, out in (("plain", plain), ("cast", cast))}
    entropy_error = {name: (out.entropy - fp32.entropy).abs().max().item() for name, out in (("plain", plain),
                                                                                           ("cast", cast))}
    print("mean |log-prob error| vs fp32:", error, "max |entropy error|:", entropy_error)
    assert error["cast"] < error["plain"] and entropy_error["cast"] < entropy_error["plain"]


def test_cast_lm_head_to_fp32_refuses_an_output_layer_it_cannot_upcast():
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(PlaitError, match="cast_lm_head_to_fp32=True needs a plain linear output layer"):
        token_logprobs(model, torch.tensor([[3, 4, 5]]), cast_lm_head_to_fp32=True)
