"""Training the tiny VLM (plait.testing.tiny_vlm) on coloured shapes: SFT learns to name the colour,
DPO's preference about the image raises its held-out margin, GRPO samples and trains from image prompts."""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import GenerationConfig

from plait import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, PlaitError, SFTConfig, SFTTrainer, make_plugins
from plait.data.prepare import prepare_dataset
from plait.data.vision import model_inputs
from plait.engine.logprobs import token_logprobs
from plait.testing.tiny_vlm import COLOURS, said_colour, shapes_dataset, tiny_qwen2_vl


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def common(output_dir, **kw):
    return dict(output_dir=str(output_dir), per_device_train_batch_size=8, report_to=[], save_strategy="no",
                disable_tqdm=True, lr_scheduler_type="constant", logging_steps=10, **kw)


def colour_choice(model, processor, rows):
    """Held-out accuracy of naming the colour (the most likely of the four answers) and the mean
    NLL of the right one among them, scored through plait's log-prob path with the images."""
    plugins, colours = make_plugins(), list(COLOURS)
    candidates = [{**row, "completion": [{"role": "assistant", "content": [{"type": "text", "text": c}]}]}
                  for row in rows for c in colours]
    data = prepare_dataset(candidates, processor, "language_modeling")
    collate = plugins.collators.get("collator.images").obj(
        processor, inner=plugins.collators.get("collator.language_modeling").obj(processor))
    batch = collate([data[i] for i in range(len(data))])
    model.eval()
    with torch.no_grad():
        logps = token_logprobs(model, batch["input_ids"], batch["attention_mask"], **model_inputs(batch)).logps
    model.train()
    scores = (logps * (batch["labels"] != -100)).sum(-1).view(len(rows), len(colours))
    truth = torch.tensor([colours.index(row["completion"][0]["content"][0]["text"]) for row in rows])
    nll = -scores.log_softmax(-1).gather(1, truth[:, None]).mean().item()
    return (scores.argmax(-1) == truth).float().mean().item(), nll


def test_sft_learns_to_name_the_colour_of_the_shape(tiny_vlm_path, tmp_path):
    held_out = shapes_dataset(24, seed=99)
    args = SFTConfig(**common(tmp_path, max_steps=50, learning_rate=3e-3))
    trainer = SFTTrainer(str(tiny_vlm_path), args=args, train_dataset=shapes_dataset(400, seed=0))
    accuracy0, nll0 = colour_choice(trainer.model, trainer.processing_class, held_out)
    trainer.train()
    accuracy, nll = colour_choice(trainer.model, trainer.processing_class, held_out)
    assert accuracy0 < 0.5 and accuracy >= 0.75, (accuracy0, accuracy)
    assert nll < nll0 / 2, (nll0, nll)


def test_dpo_on_image_preferences_raises_the_held_out_margin(tiny_vlm_path, tmp_path):
    args = DPOConfig(**common(tmp_path, max_steps=40, learning_rate=1e-3, beta=0.1, per_device_eval_batch_size=16))
    trainer = DPOTrainer(str(tiny_vlm_path), args=args, train_dataset=shapes_dataset(400, seed=0, kind="preference"),
                         eval_dataset=shapes_dataset(32, seed=99, kind="preference"))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_rewards/margins"] > before["eval_rewards/margins"] + 0.1, (before, after)
    assert after["eval_rewards/accuracies"] > 0.7, after


def test_dpo_precomputed_reference_logps_see_the_images(tiny_vlm_path, tmp_path):
    data = shapes_dataset(8, seed=0, kind="preference")
    args = DPOConfig(**{**common(tmp_path, max_steps=1, learning_rate=1e-3), "per_device_train_batch_size": 4},
                     precompute_ref_log_probs=True)
    trainer = DPOTrainer(str(tiny_vlm_path), args=args, train_dataset=data)
    row = trainer.train_dataset[0]
    batch = trainer.data_collator([row])
    with torch.no_grad():
        logps = token_logprobs(trainer.model, batch["input_ids"], batch["attention_mask"], **model_inputs(batch)).logps
    chosen = (logps * batch["completion_mask"]).sum(-1)[0]
    assert row["ref_chosen_logps"] == pytest.approx(float(chosen), abs=1e-4)  # the reference is the initial policy
    trainer.train()


def said(completions, colour, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(want in text) for want, text in zip(colour, texts)]


def test_grpo_samples_from_image_prompts_and_shows_them(tiny_vlm_path, tmp_path, capsys):
    args = GRPOConfig(**{**common(tmp_path, max_steps=2, learning_rate=1e-3), "logging_steps": 1},
                      num_generations=4, max_completion_length=4, log_completions=True, beta=0.04)
    trainer = GRPOTrainer(str(tiny_vlm_path), reward_funcs=said, args=args,
                          train_dataset=shapes_dataset(16, seed=0, kind="prompt_only"))
    trainer.train()
    table = capsys.readouterr().out
    assert "image 32x32" in table and "user: [image]What colour is the shape?" in table
    assert trainer.state.log_history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference saw the same images


def test_grpo_with_vllm_refuses_image_prompts_before_loading(tmp_path):
    args = GRPOConfig(**common(tmp_path, max_steps=1), num_generations=4, use_vllm=True)
    with pytest.raises(PlaitError, match="cannot pass images.*use_vllm=False"):
        GRPOTrainer("/nonexistent-model", reward_funcs=said, args=args,
                    train_dataset=shapes_dataset(4, kind="prompt_only"))


@pytest.mark.parametrize("method", ["sft", "dpo", "grpo"])
def test_qwen2_vl_trains_with_each_method(method, tmp_path):
    """Two steps of each method on a tiny Qwen2-VL (flattened patches, image_grid_thw, M-RoPE token types)."""
    model, processor = tiny_qwen2_vl()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "visual" in n}
    base = {**common(tmp_path, max_steps=2, learning_rate=1e-2), "per_device_train_batch_size": 4}
    if method == "sft":
        trainer = SFTTrainer(model, args=SFTConfig(**base), processing_class=processor, train_dataset=shapes_dataset(8))
    elif method == "dpo":
        trainer = DPOTrainer(model, args=DPOConfig(**base), processing_class=processor,
                             train_dataset=shapes_dataset(8, kind="preference"))
    else:
        trainer = GRPOTrainer(model, reward_funcs=said_colour, processing_class=processor,
                              args=GRPOConfig(**base, num_generations=4, max_completion_length=4, beta=0.04),
                              train_dataset=shapes_dataset(8, kind="prompt_only"))
    trainer.train()
    moved = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    if method != "grpo":  # GRPO's random-policy rewards are all 0 here: no advantage, no gradient
        assert moved, "the vision tower got no gradient"


def test_max_pixels_reaches_an_image_processor_that_has_it(tiny_vlm_path, tmp_path):
    model, processor = tiny_qwen2_vl()
    args = SFTConfig(**common(tmp_path, max_steps=1), max_pixels=16 * 16)
    trainer = SFTTrainer(model, args=args, processing_class=processor, train_dataset=shapes_dataset(4))
    row = trainer.train_dataset[0]
    assert sum(t == processor.image_token_id for t in row["input_ids"]) == 4  # 16x16 pixels: 4x4 patches, merged 2x2
    assert model_inputs(trainer.data_collator([row]))["image_grid_thw"].tolist() == [[1, 4, 4]]
    with pytest.raises(PlaitError, match="max_pixels=256: the processing class has a CLIPImageProcessorPil"):
        SFTTrainer(str(tiny_vlm_path), args=args, train_dataset=shapes_dataset(4))


def test_kto_on_image_pairs_feeds_the_images_to_the_mismatched_pairs_too(tiny_vlm_path, tmp_path):
    from plait import KTOConfig, KTOTrainer

    args = KTOConfig(**{**common(tmp_path, max_steps=2, learning_rate=1e-3), "per_device_train_batch_size": 4})
    trainer = KTOTrainer(str(tiny_vlm_path), args=args, train_dataset=shapes_dataset(8, kind="preference"))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert len(batch["model_inputs"]) == batch["kl_input_ids"].shape[0] == 4
    trainer.train()
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_log_completions_callback_generates_with_the_prompt_images(tiny_vlm_path, tmp_path, capsys):
    from plait import LogCompletionsCallback

    args = SFTConfig(**common(tmp_path, max_steps=1, learning_rate=1e-3))
    trainer = SFTTrainer(str(tiny_vlm_path), args=args, train_dataset=shapes_dataset(8),
                         eval_dataset=shapes_dataset(2, seed=4))
    callback = LogCompletionsCallback(trainer, GenerationConfig(max_new_tokens=3, do_sample=False), freq=1)
    trainer.add_callback(callback)
    trainer.train()
    assert [row[3] for row in callback.table] == ["image 32x32", "image 32x32"]
    assert callback.table[0][1].count("<image>") == 16  # the prompt, its image tokens expanded
    assert "image 32x32" in capsys.readouterr().out


def test_grpo_with_a_reward_about_the_image_raises_it(tiny_vlm_path, tmp_path):
    """From a briefly fine-tuned tiny VLM (40 SFT steps: it answers with a colour word, often the wrong
    one), GRPO rewarded for naming the shape's colour raises that reward. Measured here: the mean
    reward of the first 10 of 40 steps 0.23, of the last 10 0.43."""
    sft = SFTTrainer(str(tiny_vlm_path), args=SFTConfig(**common(tmp_path / "sft", max_steps=40, learning_rate=3e-3)),
                     train_dataset=shapes_dataset(200, seed=0))
    sft.train()
    args = GRPOConfig(**{**common(tmp_path / "grpo", max_steps=40, learning_rate=1e-3), "per_device_train_batch_size": 32,
                         "logging_steps": 1}, num_generations=4, max_completion_length=6, beta=0.0, temperature=1.0)
    trainer = GRPOTrainer(sft.model, reward_funcs=said_colour, processing_class=sft.processing_class, args=args,
                          train_dataset=shapes_dataset(200, seed=5, kind="prompt_only"))
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, (first, last)


def test_async_grpo_refuses_image_prompts_before_loading(tmp_path):
    from plait import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(**common(tmp_path, max_steps=1), num_generations=4)
    with pytest.raises(PlaitError, match="AsyncGRPOTrainer does not pass images.*train with: cpo, dpo, grpo, kto, orpo, rloo, sft"):
        AsyncGRPOTrainer("/nonexistent-model", reward_funcs=said, args=args,
                         train_dataset=shapes_dataset(4, kind="prompt_only"))


@pytest.mark.parametrize("name,kind", [("ORPO", "preference"), ("CPO", "preference"), ("RLOO", "prompt_only")])
def test_other_methods_whose_forwards_pass_images_train_two_steps(tiny_vlm_path, tmp_path, name, kind):
    import plait

    extra = {"num_generations": 4, "max_completion_length": 4} if kind == "prompt_only" else {}
    args = getattr(plait, f"{name}Config")(**{**common(tmp_path, max_steps=2, learning_rate=1e-3),
                                              "per_device_train_batch_size": 4}, **extra)
    rewards = {"reward_funcs": said_colour} if kind == "prompt_only" else {}
    trainer = getattr(plait, f"{name}Trainer")(str(tiny_vlm_path), args=args, train_dataset=shapes_dataset(8, kind=kind),
                                               **rewards)
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_method_that_cannot_pass_images_refuses_them_before_loading(tmp_path):
    from plait import RewardConfig, RewardTrainer

    with pytest.raises(PlaitError, match="RewardTrainer does not pass images to the model"):
        RewardTrainer("/nonexistent-model", args=RewardConfig(**common(tmp_path, max_steps=1)),
                      train_dataset=shapes_dataset(4, kind="preference"))
