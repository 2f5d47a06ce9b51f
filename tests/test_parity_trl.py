"""Parity with TRL 1.16: plait's trainers and TRL's compute the same loss and gradient on the same batch.

Both frameworks get the same tiny model (a perturbed policy and its unperturbed reference) and
one hand-made batch, fed straight to ``compute_loss``: tokenisation and collation are out of
the picture, so a mismatch is a difference in loss semantics. Where TRL refuses a setting,
plait must refuse it too. Every intentional difference is listed in docs/trl-differences.md and
pinned here by its own test: what TRL computes under one setting, plait computes under the
setting the table names.

TRL lives in its own venv (``make test-parity``); in the main venv this module is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")  # noqa: E402  (only .venv-trl has it: make test-parity)

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

from plait import PlaitError  # noqa: E402
from plait.plugins.methods import dpo as plait_dpo, grpo as plait_grpo, kto as plait_kto  # noqa: E402
from plait.plugins.methods import reward_model as plait_rm  # noqa: E402
from plait.testing.tiny_model import noisy_tiny_model, tiny_model_path  # noqa: E402

pytestmark = pytest.mark.skipif(not trl.__version__.startswith("1.16."), reason="parity is pinned to TRL 1.16")

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


# -- shared inputs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def reference():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def policy():
    """The reference with noise on every weight: log-ratios of a few nats, so every term matters."""
    return noisy_tiny_model(seed=0, scale=0.05)


def right_padded(lengths: list[tuple[int, int]], width: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of (prompt length, completion length) random tokens, right-padded to ``width``."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    input_ids = torch.randint(5, 900, (rows, width), generator=generator)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    completion_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, (prompt, completion) in enumerate(lengths):
        attention_mask[i, :prompt + completion] = 1
        completion_mask[i, prompt:prompt + completion] = 1
    return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask,
            "completion_mask": completion_mask}


# Four pairs [chosen…; rejected…] with unequal completion lengths (LD-DPO and the length-normalised
# losses see a tail) and unequal prompts.
PREFERENCE_BATCH = right_padded([(3, 5), (4, 2), (2, 7), (5, 3), (3, 4), (4, 6), (2, 3), (5, 5)], width=12, seed=1)


def loss_and_grad(trainer, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    if not hasattr(trainer, "current_gradient_accumulation_steps"):  # set by the training loop
        trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(model, {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), grad


def assert_same(ours, theirs):
    (loss, grad), (trl_loss, trl_grad) = ours, theirs
    torch.testing.assert_close(loss, trl_loss, rtol=LOSS_RTOL, atol=1e-7)
    # float32 sums in another order: entries near zero are compared at the gradient's own scale
    torch.testing.assert_close(grad, trl_grad, rtol=GRAD_RTOL, atol=1e-5 * trl_grad.abs().max().item())


def common_args(tmp_path) -> dict:
    # bf16=False: TRL 1.16 defaults to bf16 autocast even on a CPU (plait picks fp32 there; a listed
    # difference); loss semantics are compared in fp32 on both sides.
    return dict(output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                per_device_train_batch_size=4)


# -- DPO ----------------------------------------------------------------------------------------

DPO_LOSSES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
DIVERGENCES = ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
PREFERENCES = Dataset.from_list([{"prompt": "Tell me.", "chosen": " Good.", "rejected": " Bad."}] * 2)


def dpo_trainers(tmp_path, tokenizer, policy, reference, **config):
    """(TRL's trainer or the error it raised, plait's trainer or the error it raised) for one config."""
    built = []
    for config_class, trainer_class, error in ((trl.DPOConfig, trl.DPOTrainer, (ValueError, NotImplementedError)),
                                               (plait_dpo.DPOConfig, plait_dpo.DPOTrainer, PlaitError)):
        try:
            args = config_class(**common_args(tmp_path), **config)
            built.append(trainer_class(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                                       train_dataset=PREFERENCES, processing_class=tokenizer))
        except error as refused:
            built.append(refused)
    return built


def check_dpo(tmp_path, tokenizer, policy, reference, **config):
    theirs, ours = dpo_trainers(tmp_path, tokenizer, policy, reference, **config)
    if isinstance(theirs, Exception):
        assert isinstance(ours, Exception), f"TRL refuses {config} ({theirs}) but plait accepts it"
        return
    assert not isinstance(ours, Exception), f"TRL accepts {config} but plait refuses it: {ours}"
    assert_same(loss_and_grad(ours, PREFERENCE_BATCH), loss_and_grad(theirs, PREFERENCE_BATCH))


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("loss_type", DPO_LOSSES)
def test_dpo_loss_type_by_f_divergence(tmp_path, tokenizer, policy, reference, loss_type, divergence):
    extra = {"label_smoothing": 1e-3} if loss_type == "exo_pair" else {}  # TRL refuses exo_pair at 0
    check_dpo(tmp_path, tokenizer, policy, reference, loss_type=loss_type, f_divergence_type=divergence, **extra)


@pytest.mark.parametrize("coef", [0.3, 1.0, 2.0])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid_norm"])
def test_dpo_alpha_divergence_coefficient(tmp_path, tokenizer, policy, reference, loss_type, coef):
    check_dpo(tmp_path, tokenizer, policy, reference, loss_type=loss_type, f_divergence_type="alpha_divergence",
              f_alpha_divergence_coef=coef)


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.1), ("hinge", 0.1), ("ipo", 0.2), ("robust", 0.1),
                                                  ("exo_pair", 0.05), ("aot", 0.1), ("aot_unpaired", 0.2),
                                                  ("discopop", 0.1)])
def test_dpo_label_smoothing(tmp_path, tokenizer, policy, reference, loss_type, smoothing):
    check_dpo(tmp_path, tokenizer, policy, reference, loss_type=loss_type, label_smoothing=smoothing)


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["ipo"], ["robust"], ["bco_pair"], ["discopop"], ["aot"],
                                       ["aot_unpaired"]])
def test_dpo_weighting(tmp_path, tokenizer, policy, reference, loss_type):
    check_dpo(tmp_path, tokenizer, policy, reference, loss_type=loss_type, use_weighting=True)


@pytest.mark.parametrize("loss_type", [["sigmoid", "sft"], ["sft"], ["ipo"], ["sigmoid_norm"], ["apo_zero"]])
def test_dpo_ld_alpha(tmp_path, tokenizer, policy, reference, loss_type):
    check_dpo(tmp_path, tokenizer, policy, reference, loss_type=loss_type, ld_alpha=0.5)


@pytest.mark.parametrize("config", [
    dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),  # MPO
    dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], f_divergence_type="js_divergence"),
    dict(loss_type=["sigmoid_norm", "ipo"], use_weighting=True, ld_alpha=0.3),
    dict(loss_type="sigmoid", beta=0.5),
])
def test_dpo_composed(tmp_path, tokenizer, policy, reference, config):
    check_dpo(tmp_path, tokenizer, policy, reference, **config)


# -- DPO: the listed differences (docs/trl-differences.md) -----------------------------------------


def test_dpo_exo_pair_reads_label_smoothing_0_as_the_papers_1e3(tmp_path, tokenizer, policy, reference):
    theirs, ours = dpo_trainers(tmp_path, tokenizer, policy, reference, loss_type="exo_pair")
    assert isinstance(theirs, ValueError) and "greater than 0.0" in str(theirs)  # TRL refuses its own default
    (theirs_at_1e3, _) = dpo_trainers(tmp_path, tokenizer, policy, reference, loss_type="exo_pair",
                                      label_smoothing=1e-3)
    assert_same(loss_and_grad(ours, PREFERENCE_BATCH), loss_and_grad(theirs_at_1e3, PREFERENCE_BATCH))


def test_dpo_weighting_with_hinge_trains_where_trl_cannot(tmp_path, tokenizer, policy, reference):
    theirs, ours = dpo_trainers(tmp_path, tokenizer, policy, reference, loss_type="hinge", use_weighting=True)
    theirs.model.train()
    trl_loss = theirs.compute_loss(theirs.model, dict(PREFERENCE_BATCH))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        trl_loss.backward()  # TRL 1.16 scales the ReLU's output in place, which its backward needs
    loss, grad = loss_and_grad(ours, PREFERENCE_BATCH)
    torch.testing.assert_close(loss, trl_loss.detach(), rtol=LOSS_RTOL, atol=1e-7)
    assert torch.isfinite(grad).all() and grad.abs().max() > 0


def test_dpo_weighting_with_sft_runs_where_trl_crashes(tmp_path, tokenizer, policy, reference):
    def plait_loss(**config):
        return loss_and_grad(dpo_trainers(tmp_path, tokenizer, policy, reference, **config)[1], PREFERENCE_BATCH)[0]

    theirs, ours = dpo_trainers(tmp_path, tokenizer, policy, reference, loss_type=["sigmoid", "sft"],
                                use_weighting=True)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        loss_and_grad(theirs, PREFERENCE_BATCH)  # TRL 1.16 scales its expanded SFT loss in place
    # plait: the WPO-weighted sigmoid loss plus the batch NLL scaled by the mean pair weight
    stats = ours.token_logprobs(ours.model, PREFERENCE_BATCH["input_ids"], PREFERENCE_BATCH["attention_mask"],
                                with_collision=True)
    weights = ours._wpo_weights(stats, PREFERENCE_BATCH["completion_mask"], None)
    expected = plait_loss(loss_type="sigmoid", use_weighting=True) + plait_loss(loss_type="sft") * weights.mean()
    torch.testing.assert_close(loss_and_grad(ours, PREFERENCE_BATCH)[0], expected, rtol=1e-5, atol=1e-7)


# -- GRPO ---------------------------------------------------------------------------------------

GRPO_LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
PROMPTS = Dataset.from_list([{"prompt": f"Count to {i}."} for i in range(8)])


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def rollout(policy):
    """One generation batch as both trainers store it: left-padded prompts, right-padded completions,
    advantages, and old/reference log-probs a few tenths of a nat away from the policy's."""
    prompts = right_padded([(0, 3), (0, 5), (0, 4), (0, 2)], width=5, seed=2)
    prompt_mask = prompts["completion_mask"].flip(-1)  # left padding
    prompt_ids = prompts["input_ids"].flip(-1) * prompt_mask
    completions = right_padded([(0, 6), (0, 3), (0, 8), (0, 5)], width=8, seed=3)
    completion_ids, completion_mask = completions["input_ids"], completions["completion_mask"]
    with torch.no_grad():
        logits = policy(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                        attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
    logps = logits[:, 4:-1].log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    generator = torch.Generator().manual_seed(4)
    old = logps + 0.3 * torch.randn(logps.shape, generator=generator)
    ref = logps + 0.5 * torch.randn(logps.shape, generator=generator)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=torch.tensor([1.2, -0.4, 0.7, -1.5]),
                old_logps=old, ref_logps=ref, num_items_in_batch=completion_mask.sum().float())


def trl_rollout(r: dict) -> dict:
    return {"prompt_ids": r["prompt_ids"], "prompt_mask": r["prompt_mask"], "completion_ids": r["completion_ids"],
            "completion_mask": r["completion_mask"], "advantages": r["advantages"],
            "old_per_token_logps": r["old_logps"], "ref_per_token_logps": r["ref_logps"],
            "num_items_in_batch": r["num_items_in_batch"]}


def plait_rollout(r: dict) -> dict:
    return {"input_ids": torch.cat([r["prompt_ids"], r["completion_ids"]], 1),
            "attention_mask": torch.cat([r["prompt_mask"], r["completion_mask"]], 1),
            "completion_mask": r["completion_mask"], "prompt_length": r["prompt_ids"].shape[1],
            "advantages": r["advantages"], "old_logps": r["old_logps"], "ref_logps": r["ref_logps"],
            "num_items_in_batch": r["num_items_in_batch"]}


def check_grpo(tmp_path, policy, rollout, **config):
    config = dict(num_generations=4, max_completion_length=8, **config)
    theirs = trl.GRPOTrainer(model=copy.deepcopy(policy), reward_funcs=constant_reward, train_dataset=PROMPTS,
                             args=trl.GRPOConfig(**common_args(tmp_path), **config))
    ours = plait_grpo.GRPOTrainer(copy.deepcopy(policy), reward_funcs=constant_reward, train_dataset=PROMPTS,
                                  args=plait_grpo.GRPOConfig(**common_args(tmp_path), **config))
    assert_same(loss_and_grad(ours, plait_rollout(rollout)), loss_and_grad(theirs, trl_rollout(rollout)))


def test_grpo_high_entropy_mask_helper_equals_trls(tmp_path, policy):
    """GRPOTrainer.get_high_entropy_mask, TRL's helper: the same tokens at every quantile."""
    config = dict(num_generations=4, max_completion_length=8)
    theirs = trl.GRPOTrainer(model=copy.deepcopy(policy), reward_funcs=constant_reward, train_dataset=PROMPTS,
                             args=trl.GRPOConfig(**common_args(tmp_path), **config))
    ours = plait_grpo.GRPOTrainer(copy.deepcopy(policy), reward_funcs=constant_reward, train_dataset=PROMPTS,
                                  args=plait_grpo.GRPOConfig(**common_args(tmp_path), **config))
    g = torch.Generator().manual_seed(3)
    entropies, mask = torch.rand(3, 7, generator=g) * 3, (torch.rand(3, 7, generator=g) > 0.3).int()
    for threshold in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert torch.equal(ours.get_high_entropy_mask(entropies, mask, threshold),
                           theirs.get_high_entropy_mask(entropies, mask, threshold))


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", GRPO_LOSSES)
def test_grpo_loss_type(tmp_path, policy, rollout, loss_type, beta):
    check_grpo(tmp_path, policy, rollout, loss_type=loss_type, beta=beta)


@pytest.mark.parametrize("config", [
    dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence"),
    dict(loss_type="luspo", beta=0.04, importance_sampling_level="sequence"),
    dict(loss_type="bnpo", importance_sampling_level="sequence"),
    dict(loss_type="dapo", epsilon_high=0.28, delta=1.3),
    dict(loss_type="cispo", epsilon_high=1.1, beta=0.04),
])
def test_grpo_options(tmp_path, policy, rollout, config):
    check_grpo(tmp_path, policy, rollout, **config)


@pytest.mark.parametrize("config", [
    dict(loss_type="dapo", entropy_coef=0.01),
    dict(loss_type="grpo", entropy_coef=-0.05, top_entropy_quantile=0.5),
    dict(loss_type="bnpo", top_entropy_quantile=0.2, beta=0.04),
    dict(loss_type="sapo", top_entropy_quantile=0.0),
    dict(loss_type="dapo", cast_lm_head_to_fp32=True, entropy_coef=0.01),
])
def test_grpo_entropy_options(tmp_path, policy, rollout, config):
    check_grpo(tmp_path, policy, rollout, **config)


@pytest.mark.parametrize("config", [
    dict(loss_type="dapo", off_policy_mask_threshold=0.0),  # drops rows 0 and 2
    dict(loss_type="luspo", off_policy_mask_threshold=0.05, beta=0.04),  # drops row 2
    dict(loss_type="cispo", off_policy_mask_threshold=0.0, entropy_coef=0.02, top_entropy_quantile=0.5),
])
def test_grpo_off_policy_mask(tmp_path, policy, rollout, config):
    # every advantage negative: rows 0 and 2 drifted from π_old by a mean 0.006 and 0.134 nats (the
    # others by a negative amount), so a threshold of 0 drops both and 0.05 row 2 only
    check_grpo(tmp_path, policy, {**rollout, "advantages": -rollout["advantages"].abs()}, **config)


def test_grpo_adaptive_entropy_coefficient(tmp_path, policy, rollout):
    """Two optimizer steps: no bonus on the first (no entropy measured yet), then the coefficient both
    stepped up by Δ (the tiny model's entropy is below the target)."""
    config = dict(num_generations=4, max_completion_length=8, loss_type="dapo", use_adaptive_entropy=True,
                  entropy_coef=0.1, entropy_target=100.0, entropy_coef_delta=0.05, top_entropy_quantile=0.5)
    theirs = trl.GRPOTrainer(model=copy.deepcopy(policy), reward_funcs=constant_reward, train_dataset=PROMPTS,
                             args=trl.GRPOConfig(**common_args(tmp_path), **config))
    ours = plait_grpo.GRPOTrainer(copy.deepcopy(policy), reward_funcs=constant_reward, train_dataset=PROMPTS,
                                  args=plait_grpo.GRPOConfig(**common_args(tmp_path), **config))
    for _ in range(2):
        assert_same(loss_and_grad(ours, plait_rollout(rollout)), loss_and_grad(theirs, trl_rollout(rollout)))
    assert ours.objective.terms[-1].params.controller.coef == pytest.approx(theirs.entropy_coef) == 0.2


# -- KTO (unpaired data) ------------------------------------------------------------------------

UNPAIRED = Dataset.from_list([{"prompt": "Tell me.", "completion": " Good.", "label": True},
                              {"prompt": "Tell me.", "completion": " Bad.", "label": False}] * 2)


@pytest.fixture(scope="module")
def unpaired_batch():
    rows = right_padded([(3, 5), (4, 2), (2, 7), (5, 3), (3, 4)], width=10, seed=5)
    mismatched = right_padded([(3, 4), (4, 5), (2, 2), (5, 7), (3, 3)], width=12, seed=6)
    return rows, mismatched, torch.tensor([True, False, True, True, False])


@pytest.mark.parametrize("config", [dict(loss_type="kto"), dict(loss_type="apo_zero_unpaired"),
                                    dict(loss_type="kto", beta=0.3, desirable_weight=1.3, undesirable_weight=0.7)])
def test_kto_unpaired(tmp_path, tokenizer, policy, reference, unpaired_batch, config):
    rows, mismatched, label = unpaired_batch
    trainers = [
        trainer_class(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), train_dataset=UNPAIRED,
                      processing_class=tokenizer, args=config_class(**common_args(tmp_path), **config))
        for config_class, trainer_class in ((trl.KTOConfig, trl.KTOTrainer),
                                            (plait_kto.KTOConfig, plait_kto.KTOTrainer))
    ]
    theirs = {**rows, "label": label, **{f"KL_{k}": v for k, v in mismatched.items()}}
    ours = {**rows, "label": label, **{f"kl_{k}": v for k, v in mismatched.items()}}
    assert_same(loss_and_grad(trainers[1], ours), loss_and_grad(trainers[0], theirs))


# -- reward model -------------------------------------------------------------------------------


@pytest.mark.parametrize("config, margin", [(dict(), False), (dict(center_rewards_coefficient=0.01), False),
                                            (dict(), True)])
def test_reward_model(tmp_path, tokenizer, config, margin):
    data = Dataset.from_list([{"chosen": "Good.", "rejected": "Bad."}] * 2)
    head = AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1)
    head.config.pad_token_id = tokenizer.pad_token_id
    trainers = [
        trainer_class(model=copy.deepcopy(head), train_dataset=data, processing_class=tokenizer,
                      args=config_class(**common_args(tmp_path), **config))
        for config_class, trainer_class in ((trl.RewardConfig, trl.RewardTrainer),
                                            (plait_rm.RewardConfig, plait_rm.RewardTrainer))
    ]
    batch = right_padded([(0, 5), (0, 3), (0, 7), (0, 4), (0, 6), (0, 2)], width=8, seed=7)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if margin:
        inputs["margin"] = torch.tensor([0.5, -0.2, 1.0])
    assert_same(loss_and_grad(trainers[1], inputs), loss_and_grad(trainers[0], inputs))


# -- data preparation: truncation and KTO's mismatched pairs ------------------------------------

LONG_PAIRS = Dataset.from_list([
    {"prompt": "The sky is", "chosen": " very blue today.", "rejected": " red"},  # 5 + 9 / 5 + 3 tokens
    {"prompt": "Sky:", "chosen": " blue", "rejected": " red"},
    {"prompt": "one two three four", "chosen": " a", "rejected": " red"},  # a 10-token prompt
])


def both_trainers(tmp_path, name, model, data, tokenizer, plait_only=None, **config):
    """(TRL's trainer, plait's) for method ``name`` ("DPO", "KTO", "Reward") on the same data and config
    (``plait_only``: fields TRL's config lacks)."""
    modules = {"DPO": plait_dpo, "KTO": plait_kto, "Reward": plait_rm}
    args = {**common_args(tmp_path), **config}
    return [getattr(module, f"{name}Trainer")(model=copy.deepcopy(model), train_dataset=data, processing_class=tokenizer,
                                              args=getattr(module, f"{name}Config")(**args, **(extra or {})))
            for module, extra in ((trl, None), (modules[name], plait_only))]


def collated(trainer, keys):
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(rows)
    return {key: batch[key].tolist() for key in keys}


def test_dpo_default_truncation_collates_the_same_batch(tmp_path, tokenizer, reference):
    # padded rows in both, to compare them row by row (plait's default packs them: test_packed_attention)
    theirs, ours = both_trainers(tmp_path, "DPO", reference, LONG_PAIRS, tokenizer, max_length=8, padding_free=False)
    assert ours.args.truncation_mode == theirs.args.truncation_mode == "keep_start"
    keys = ("input_ids", "attention_mask", "completion_mask")
    assert len(ours.train_dataset) == len(theirs.train_dataset) == 2  # the 10-token prompt is dropped by both
    assert collated(ours, keys) == collated(theirs, keys)


def test_reward_model_drops_pairs_longer_than_max_length(tmp_path, tokenizer):
    head = AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1)
    head.config.pad_token_id = tokenizer.pad_token_id
    theirs, ours = both_trainers(tmp_path, "Reward", head, LONG_PAIRS, tokenizer, max_length=8,
                                 plait_only={"padding_free": False})  # padded rows, compared row by row
    assert collated(ours, ("input_ids", "attention_mask")) == collated(theirs, ("input_ids", "attention_mask"))
    assert len(ours.train_dataset) == 1


KTO_LONG = Dataset.from_list([{"prompt": "The sky is", "completion": " very blue today.", "label": True},
                              {"prompt": "Sky:", "completion": " red", "label": False},
                              {"prompt": "one two three four", "completion": " a", "label": True},
                              {"prompt": "A", "completion": " b c d e f g h", "label": False}])


def test_kto_truncation_keeps_the_start_and_the_row(tmp_path, tokenizer, reference):
    theirs, ours = both_trainers(tmp_path, "KTO", reference, KTO_LONG, tokenizer, max_length=8,
                                 plait_only={"padding_free": False})  # padded rows
    assert collated(ours, ("input_ids", "attention_mask", "completion_mask", "label")) == \
        collated(theirs, ("input_ids", "attention_mask", "completion_mask", "label"))
    # every mismatched pair is the same sequence: "Sky:" borrows " very blue today." cut to its own room
    # (4 tokens), not as cut beside its own longer prompt (3 tokens)
    kl = ("input_ids", "attention_mask", "completion_mask")
    assert collated(ours, [f"kl_{k}" for k in kl]) == {f"kl_{k.removeprefix('KL_')}": v for k, v in
                                                       collated(theirs, [f"KL_{k}" for k in kl]).items()}


def test_kto_loss_on_truncated_rows_equals_trls(tmp_path, tokenizer, reference):
    # this policy's KL estimate is above 0 (not clamped), so it reads every mismatched pair: cutting the
    # borrowed completion as it was cut beside its own prompt moved the loss by 1.6e-3 relative
    policy = noisy_tiny_model(seed=1, scale=0.05)
    trainers = [trainer_class(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), train_dataset=KTO_LONG,
                              processing_class=tokenizer, args=config_class(**common_args(tmp_path), max_length=8,
                                                                            **extra))
                for config_class, trainer_class, extra in ((trl.KTOConfig, trl.KTOTrainer, {}),
                                                           (plait_kto.KTOConfig, plait_kto.KTOTrainer,
                                                            {"padding_free": False}))]
    batches = [t.data_collator([t.train_dataset[i] for i in range(len(t.train_dataset))]) for t in trainers]
    assert_same(loss_and_grad(trainers[1], batches[1]), loss_and_grad(trainers[0], batches[0]))


def test_kto_paired_data_never_pairs_a_prompt_with_its_own_completion_where_trl_does(tmp_path, tokenizer, reference):
    """TRL 1.16 unpairs as [all chosen; all rejected] and rotates by one within each batch of 4:
    with 3 pairs, the first batch is chosen 1-3 and rejected 1, and prompt 1 meets its own rejected
    completion. plait keeps a pair's rows together and never pairs a prompt with its own completion."""
    data = Dataset.from_list([{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.",
                               "rejected": f" The {w} is bad."} for w in ("apple", "river", "stone")])
    theirs, ours = both_trainers(tmp_path, "KTO", reference, data, tokenizer)

    def own_prompt_pairs(dataset, kl_column):
        rows = [dataset[i] for i in range(len(dataset))]
        return sum(r[kl_column] in [o["completion_ids"] for o in rows if o["prompt_ids"] == r["prompt_ids"]] for r in rows)

    assert own_prompt_pairs(theirs.train_dataset, "KL_completion_ids") == 1
    assert own_prompt_pairs(ours.train_dataset, "kl_completion_ids") == 0
    assert ours.args.train_sampling_strategy == theirs.args.train_sampling_strategy == "sequential"


@pytest.mark.parametrize("name, config", [
    ("KTO", dict(sync_ref_model=True, precompute_ref_log_probs=True)),
    ("DPO", dict(sync_ref_model=True, precompute_ref_log_probs=True)),
])
def test_sync_ref_model_refusals(tmp_path, tokenizer, reference, name, config):
    for module, error in ((trl, (ValueError, NotImplementedError)), ({"KTO": plait_kto, "DPO": plait_dpo}[name], PlaitError)):
        with pytest.raises(error):
            trainer_class, config_class = getattr(module, f"{name}Trainer"), getattr(module, f"{name}Config")
            data = UNPAIRED if name == "KTO" else PREFERENCES
            trainer_class(model=copy.deepcopy(reference), train_dataset=data, processing_class=tokenizer,
                          args=config_class(**common_args(tmp_path), **config))


def test_grpo_sync_ref_model_with_beta_0_is_refused_by_both(tmp_path, policy):
    for module, error in ((trl, ValueError), (plait_grpo, PlaitError)):
        with pytest.raises(error, match="sync_ref_model=True"):
            module.GRPOTrainer(model=copy.deepcopy(policy), reward_funcs=constant_reward, train_dataset=PROMPTS,
                               args=module.GRPOConfig(**common_args(tmp_path), num_generations=4, beta=0.0,
                                                      sync_ref_model=True))


def test_a_peft_policy_s_reference_is_its_initial_adapter_in_both(tmp_path, tokenizer, reference):
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import use_adapter

    model = get_peft_model(copy.deepcopy(reference), LoraConfig(r=4, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    theirs, ours = both_trainers(tmp_path, "DPO", model, PREFERENCES, tokenizer)
    ids = PREFERENCE_BATCH["input_ids"][:2]
    with torch.no_grad(), use_adapter(theirs.model, "ref"):
        expected = theirs.model(input_ids=ids).logits
    got = ours.reference(ours.model, lambda m: m(input_ids=ids).logits)
    torch.testing.assert_close(got, expected)
    assert sum(p.numel() for p in ours.model.parameters()) == sum(p.numel() for p in theirs.model.parameters())
