"""Streamed datasets (issue 36): an ``IterableDataset`` as ``train_dataset`` with ``max_steps``, as TRL 1.16 takes it.

Rows are prepared lazily (``IterableDataset.map``) as training reads them, so an endless stream trains; a
stream without ``max_steps`` and settings that need the whole dataset are one-line errors before any model
loads; the online methods read a stream in the order their group sampler reads indices; a stopped run
resumes on a stream to the uninterrupted run's weights; the ``plait`` command streams a local file.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset, IterableDataset
from safetensors.torch import load_file
from transformers import TrainerCallback

import plait
from plait.cli import main
from plait.data.prepare import pack_dataset, prepare_dataset
from plait.errors import PlaitError
from plait.testing.tiny_model import tiny_model_path

MISSING = "/nonexistent/model"  # a refusal that names it came before any load
PLAIT = Path(sys.executable).parent / "plait"
WORDS = ["The river", "A good answer", "Python is", "The weather today", "Once upon a time", "My favourite food"]
QUIET = dict(report_to=[], disable_tqdm=True, save_strategy="no", logging_steps=1, seed=0, learning_rate=1e-2)
ROWS = {
    "sft": [{"prompt": w, "completion": " is a fine thing to say."} for w in WORDS],
    "dpo": [{"prompt": w, "chosen": " runs to the sea.", "rejected": " no"} for w in WORDS],
    "kto": [{"prompt": w, "completion": " runs." if i % 2 else " x", "label": bool(i % 2)} for i, w in enumerate(WORDS)],
}
ROWS["reward"] = ROWS["dpo"]
TRAINERS = {"sft": (plait.SFTTrainer, plait.SFTConfig), "dpo": (plait.DPOTrainer, plait.DPOConfig),
            "kto": (plait.KTOTrainer, plait.KTOConfig), "reward": (plait.RewardTrainer, plait.RewardConfig)}


def endless(rows: list[dict]) -> IterableDataset:
    """A stream that never ends: preparing it whole would never return."""
    return IterableDataset.from_generator(lambda: itertools.cycle(rows))


def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("method", sorted(TRAINERS))
def test_offline_methods_train_on_an_endless_stream(tmp_path, method):
    trainer_class, config = TRAINERS[method]
    args = config(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, max_length=32, **QUIET)
    trainer = trainer_class(str(tiny_model_path()), args=args, train_dataset=endless(ROWS[method]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = losses(trainer)
    assert len(logged) == 3 and logged[-1] < logged[0]  # it learns from the streamed rows
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("method", sorted(TRAINERS))
def test_a_stream_without_max_steps_is_refused_before_the_model_loads(tmp_path, method):
    trainer_class, config = TRAINERS[method]
    with pytest.raises(PlaitError, match="max_steps=-1 but train_dataset is a stream") as err:
        trainer_class(MISSING, args=config(output_dir=str(tmp_path), **QUIET), train_dataset=endless(ROWS[method]))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_precomputed_reference_log_probs_are_refused_on_a_stream(tmp_path, method):
    trainer_class, config = TRAINERS[method]
    args = config(output_dir=str(tmp_path), max_steps=2, precompute_ref_log_probs=True, **QUIET)
    with pytest.raises(PlaitError, match="precompute_ref_log_probs=True scores every row before training"):
        trainer_class(MISSING, args=args, train_dataset=endless(ROWS[method]))


def test_preparation_is_lazy_and_drops_rows_as_the_whole_path_does():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    rows = [{"prompt": "A prompt far too long for the limit " * 4, "completion": " x"}, *ROWS["sft"]]
    whole = prepare_dataset(rows, tokenizer, "language_modeling", max_length=12)
    streamed = prepare_dataset(Dataset.from_list(rows).to_iterable_dataset(), tokenizer, "language_modeling",
                               max_length=12)
    assert isinstance(streamed, IterableDataset)
    assert list(streamed) == list(whole)  # the overlong first row is dropped from both, the rest cut alike
    endless_rows = prepare_dataset(endless(ROWS["sft"]), tokenizer, "language_modeling")  # returns: nothing read
    first = prepare_dataset(ROWS["sft"][:1], tokenizer, "language_modeling")[0]
    assert list(endless_rows.take(7))[6] == first  # the stream's 7th row is its 1st again, prepared alike
    with pytest.raises(PlaitError, match="dataset row 0: its prompt .* leaves no room under max_length=12"):
        list(prepare_dataset(Dataset.from_list(rows).to_iterable_dataset(), tokenizer, "language_modeling",
                             max_length=12, on_overlong="error"))


def test_a_stream_is_packed_window_by_window():
    rows = [{"input_ids": [i] * n, "completion_mask": [1] * n} for i, n in enumerate([3, 5, 2, 4, 6, 1], start=1)]
    packed = list(pack_dataset(Dataset.from_list(rows).to_iterable_dataset(), "bfd", 8, stream_window=3))
    whole = [pack_dataset(Dataset.from_list(rows[i:i + 3]), "bfd", 8) for i in (0, 3)]
    assert packed == [row for part in whole for row in part]  # each window packed as the whole path packs it
    assert all(sum(row["seq_lengths"]) <= 8 for row in packed) and sum(len(r["input_ids"]) for r in packed) == 21


def test_sft_packs_a_stream(tmp_path):
    args = plait.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1, max_length=64,
                           packing=True, **QUIET)
    trainer = plait.SFTTrainer(str(tiny_model_path()), args=args, train_dataset=endless(ROWS["sft"]))
    first = next(iter(trainer.train_dataset))
    assert len(first["seq_lengths"]) > 1 and sum(first["seq_lengths"]) == len(first["input_ids"]) <= 64
    trainer.train()
    assert len(losses(trainer)) == 2


@pytest.mark.parametrize("trainer_class, config", [(plait.GRPOTrainer, plait.GRPOConfig),
                                                   (plait.RLOOTrainer, plait.RLOOConfig)])
def test_online_methods_read_a_stream_as_they_read_the_whole_dataset(tmp_path, trainer_class, config):
    """Each prompt num_generations times in a row, a generation batch re-served over steps_per_generation: the
    stream's run is the map-style run (unshuffled) to the last logged number."""
    seen: dict[bool, list] = {False: [], True: []}
    runs = {}
    for stream in (False, True):
        def reward(prompts, completion_ids, **kwargs):
            seen[stream].append(list(prompts))
            return low_tokens(completion_ids)

        rows = Dataset.from_list([{"prompt": w} for w in WORDS])
        args = config(output_dir=str(tmp_path / str(stream)), max_steps=3, num_generations=2, max_completion_length=4,
                      per_device_train_batch_size=2, gradient_accumulation_steps=2, shuffle_dataset=False, **QUIET)
        trainer = trainer_class(str(tiny_model_path()), args=args, reward_funcs=reward,
                                train_dataset=rows.to_iterable_dataset() if stream else rows)
        trainer.train()
        runs[stream] = [{k: v for k, v in h.items() if k != "train_runtime" and "per_second" not in k}
                        for h in trainer.state.log_history]
    assert seen[True] == seen[False] and seen[True][0] == [WORDS[0]] * 2 + [WORDS[1]] * 2
    assert runs[True] == runs[False]


def test_async_grpo_refuses_a_stream_it_cannot_read_ahead(tmp_path):
    args = plait.AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=2, num_generations=2, per_device_train_batch_size=2,
                                 **QUIET)
    with pytest.raises(PlaitError, match="AsyncGRPOTrainer's worker samples the prompts of batches ahead by their index"):
        plait.AsyncGRPOTrainer(MISSING, args=args, reward_funcs=low_tokens, train_dataset=endless(ROWS["sft"]))


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def test_a_stopped_run_resumes_on_a_stream_to_the_uninterrupted_weights(tmp_path):
    """transformers skips the batches already trained on when it resumes, and reads a stream from its start."""
    def build(output):
        args = plait.SFTConfig(output_dir=str(output), max_steps=4, per_device_train_batch_size=2, max_length=32,
                               save_strategy="steps", save_steps=2, report_to=[], disable_tqdm=True, logging_steps=1,
                               seed=0, learning_rate=1e-2)
        return plait.SFTTrainer(str(tiny_model_path()), args=args, train_dataset=endless(ROWS["sft"]))

    build(tmp_path / "straight").train()
    cut = build(tmp_path / "cut")
    cut.add_callback(StopAt(2))
    cut.train()
    build(tmp_path / "cut").train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    straight, resumed = (load_file(tmp_path / run / "checkpoint-4" / "model.safetensors") for run in ("straight", "cut"))
    assert max((straight[k] - resumed[k]).abs().max().item() for k in straight) == 0.0


@pytest.mark.slow
def test_the_plait_command_streams_a_local_file(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS["sft"]))
    base = ["sft", "--model_name_or_path", str(tiny_model_path()), "--dataset_name", str(data), "--dataset_streaming",
            "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    assert main(base) == 2
    assert "dataset.streaming: a stream has no length to count epochs by; set max_steps" in capsys.readouterr().err
    trained = subprocess.run([str(PLAIT), *base, "--max_steps", "2", "--learning_rate", "1e-2"],
                             capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    before, after = (load_file(Path(folder) / "model.safetensors") for folder in (tiny_model_path(), tmp_path / "out"))
    assert any(not torch.equal(before[k].float(), after[k].float()) for k in before)  # two streamed steps trained it
