"""Parity with TRL 1.16's experimental online DPO: the same loss, gradient and metrics on the same pairs.

Sampling is the one random part, so both trainers get the same fixed completions: plait through a
generation backend plugin that replays them (registered like any backend, chosen with
``generation_backend``), TRL by replacing its sampler method on the instance. Both rank the pairs
with the same reward function (plait's rules judge); TRL's policy and reference are plait's
(a perturbed tiny model and the unperturbed one). TRL lives in its own venv (``make
test-parity``); in the main venv this module is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")  # noqa: E402  (only .venv-trl has it: make test-parity)

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import plait  # noqa: E402
from plait import hookimpl  # noqa: E402
from plait.manager import make_plugins  # noqa: E402
from plait.online.generation import GenerationBackend, Generations
from plait.testing.tiny_model import noisy_tiny_model, tiny_model_path  # noqa: E402

pytestmark = pytest.mark.skipif(not trl.__version__.startswith("1.16."), reason="parity is pinned to TRL 1.16")

from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer  # noqa: E402

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
PROMPTS = ["The river", "Python is", "The children", "Nobody could"]
# two completions per prompt, the same length (TRL sums objective/kl over padding too), some ending in EOS
COMPLETIONS = {"The river": (" flows to the", " is wet and"), "Python is": (" a language", " fast today"),
               "The children": (" play in the", " sleep now"), "Nobody could": (" see it at", " know the")}
WIDTH = 4


def low_tokens(completion_ids, **kwargs):
    """Blind to padding (id 0): TRL hands reward functions padded completion ids, plait unpadded ones."""
    return [float(sum(0 < t < 300 for t in ids)) + 0.001 * ids[0] for ids in completion_ids]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def reference():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def policy():
    return noisy_tiny_model(seed=0, scale=0.05)


def completion_ids(tokenizer, text: str, eos: bool, width: int = WIDTH) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:width - 1 if eos else width]
    ids = ids + [tokenizer.pad_token_id] * (width - (1 if eos else 0) - len(ids))  # equal widths, no mask holes
    return ids + [tokenizer.eos_token_id] if eos else ids


SHORT = {"on": False}  # the second completions one token shorter (padded in TRL's batch)


def width(k: int) -> int:
    return WIDTH - 1 if SHORT["on"] and k == 1 else WIDTH


class Replay(GenerationBackend):
    """Returns the fixed completions of each prompt (by its text), grouped as backends do."""

    def __init__(self, processing_class):
        self.tokenizer = processing_class

    def generate(self, prompts, sampling):
        rows, out = [], []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            for k, completion in enumerate(COMPLETIONS[text][:sampling.num_generations]):
                rows.append(list(ids))
                out.append(completion_ids(self.tokenizer, completion, eos=k == 0, width=width(k)))
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in out]
        return Generations(rows, out, texts, [ids[-1] == self.tokenizer.eos_token_id for ids in out])


class ReplayPlugin:
    @hookimpl
    def register_generation_backends(register):
        register("generation.replay", lambda model, processing_class, args: Replay(processing_class))


@pytest.mark.parametrize("short", [False, True], ids=["equal_lengths", "padded"])
def test_loss_gradient_and_metrics_match_trl(tmp_path, tokenizer, policy, reference, short, monkeypatch):
    """With a padded completion the loss and rewards still agree (both mask padding there); TRL's
    objective/kl and objective/entropy also sum the padding positions' log-probs, plait's do not
    (docs/trl-differences.md)."""
    monkeypatch.setitem(SHORT, "on", short)
    common = dict(output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                  per_device_train_batch_size=len(PROMPTS), max_new_tokens=WIDTH, beta=0.1, learning_rate=1e-3)
    plugins = make_plugins(plugins=[ReplayPlugin])
    ours = plait.OnlineDPOTrainer(copy.deepcopy(policy), ref_model=copy.deepcopy(reference), reward_funcs=[low_tokens],
                                  args=plait.OnlineDPOConfig(generation_backend="replay", shuffle_dataset=False,
                                                             **common),
                                  train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer,
                                  plugins=plugins)
    batch = next(iter(ours.get_train_dataloader()))
    ours.model.train()
    out = ours.rollout(batch)
    assert out["decided"].all()  # no ties: TRL breaks them towards the first completion, plait drops them
    loss = ours.compute_loss(ours.model, out)
    loss.backward()
    plait_metrics = {k: v[-1] for k, v in ours._metrics["train"].items()}

    theirs = OnlineDPOTrainer(copy.deepcopy(policy), ref_model=copy.deepcopy(reference), reward_funcs=[low_tokens],
                              args=OnlineDPOConfig(gradient_checkpointing=False, **common),
                              train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                              processing_class=tokenizer)
    prompts = batch["prompt"][::2]
    prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"][::2], batch["attention_mask"][::2])]

    def fixed_generate(model, prompts_, images=None):  # TRL's layout: [first completions; second completions]
        left = max(map(len, prompt_ids))
        ids = torch.tensor([[tokenizer.pad_token_id] * (left - len(p)) + p for p in prompt_ids]).repeat(2, 1)
        mask = torch.tensor([[0] * (left - len(p)) + [1] * len(p) for p in prompt_ids]).repeat(2, 1)
        completions = torch.tensor([completion_ids(tokenizer, COMPLETIONS[p][k], eos=k == 0, width=width(k))
                                    + [tokenizer.pad_token_id] * (WIDTH - width(k)) for k in (0, 1) for p in prompts_])
        completion_mask = torch.tensor([[1] * width(k) + [0] * (WIDTH - width(k)) for k in (0, 1) for _ in prompts_])
        return ids, mask, completions, completion_mask, None

    theirs._generate = fixed_generate
    trl_loss = theirs.training_step(theirs.model, {"prompt": list(prompts)})
    assert torch.allclose(loss.detach(), trl_loss, rtol=LOSS_RTOL)
    for (name, a), b in zip(ours.model.named_parameters(), theirs.model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=GRAD_RTOL, atol=1e-7), name
    summed_over_padding = ("objective/kl", "objective/entropy", "objective/non_score_reward")
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected", "objective/scores", "objective/scores_margin", "val/contain_eos_token", "beta",
                 *(() if short else summed_over_padding)):
        assert plait_metrics[name] == pytest.approx(theirs.stats[name][-1], rel=1e-4, abs=1e-5), name
    if short:  # TRL adds the padding positions' log-probs (policy − reference) to each completion's KL
        assert plait_metrics["objective/entropy"] != pytest.approx(theirs.stats["objective/entropy"][-1], rel=1e-3)
    # rlhf_reward is the mean of score + non-score reward per completion: TRL's own objective/scores +
    # objective/non_score_reward. TRL's logged value passes the 2B-row tensor through gather_for_metrics,
    # which trims rows to the dataset here (2.766 vs 2.786), so the relation is what is pinned
    expected = theirs.stats["objective/scores"][-1] + plait_metrics["objective/non_score_reward"]
    assert plait_metrics["objective/rlhf_reward"] == pytest.approx(expected, rel=1e-5)
