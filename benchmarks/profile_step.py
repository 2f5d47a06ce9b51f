"""One plait optimizer step under torch's profiler: where the time goes, by op and by plait file.

    .venv/bin/python benchmarks/profile_step.py --method sft [--length 512] [--precision bf16|fp32] [--top 25]

Builds the method's trainer exactly as benchmarks/trl_side_by_side.py does (SmolLM2-135M-Instruct,
batch 4, rows of ``--length`` tokens, each library's defaults; ``--precision`` fixes bf16 autocast or
fp32, gradient checkpointing stays on as both libraries default), trains ``--step`` + 1 steps (4) and profiles
the last two: step ``--step`` is timed, the one after it attributed. Recording Python stacks, which attribution
needs, or input shapes slows a step's elementwise ops several-fold (a reward model's float32 step on AVX2,
2026-12-06: 17.4 s recording neither, 22.1 s with stacks and 22.7 s with shapes alone; its elementwise products
0.72 s against 2.40 and 2.44 s), so the timed step records neither: each op of the stacked step is charged its
share (by its own time there) of what that op took in the timed step. Prints and writes to
benchmarks/results/profile_<method>_<precision>.json:

- **by op**: self CPU time of each aten op (matmuls, attention kernels, casts, elementwise ops, the
  optimizer) and of each of plait's inductor-compiled kernels (``plait::_swiglu``, ...), the share of the step each
  takes, and matmul's share (the part a faster kernel cannot shrink further than the matmul peak);
- **by plait file**: each op's self time attributed to the innermost Python frame above it in plait's
  source (core/, plugins/, losses/, rewards/) or a library's (transformers' modeling file, torch's
  checkpointing, ...); ops the autograd engine runs for the model's own ops are one row,
  "backward (autograd)" (a plait autograd Function's backward is its own file's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")
PLAIT_FOLDERS = ("core", "plugins", "losses", "rewards")
LIBRARIES = ("transformers", "accelerate", "peft", "torch")
# frames that only pass an op on (dispatch modes, checkpointing, module calls): the owner is above them
PASS_THROUGH = ("torch/_ops.py", "torch/utils/checkpoint.py", "torch/nn/modules/module.py",
                "torch/autograd/function.py", "torch/_compile.py",
                "transformers/modeling_layers.py", "transformers/utils/generic.py",
                "transformers/utils/output_capturing.py")
# torch.compile's machinery between a compiled function's caller and its kernels: the caller owns them
COMPILED_CALLS = ("torch/_inductor/", "torch/_functorch/", "torch/_dynamo/")


def owner(event) -> str:
    """Who issued an aten op: the innermost Python frame above it (its profiler parents) in plait's source
    (core/, plugins/, losses/, rewards/) or in a library file (transformers/models/llama/..., torch/...);
    an op the autograd engine runs for a node of the model's own ops is "backward (autograd)"."""
    parent = event.cpu_parent
    while parent is not None:
        name = parent.name
        if name.startswith("autograd::engine::evaluate_function"):
            return "backward (autograd)"
        frame = name.split("(")[0] if "(" in name and ".py(" in name else None
        if frame is not None:
            parts = Path(frame).parts
            for start, part in enumerate(parts):
                path = "/".join(parts[start:])
                if ((part in PLAIT_FOLDERS or part in LIBRARIES) and path not in PASS_THROUGH
                        and not path.startswith(COMPILED_CALLS)):
                    return path
        parent = parent.cpu_parent
    return "other"


def ops(events):
    """The profiled events that are ops (not Python frames) and took time of their own: aten's, and plait's
    inductor-compiled kernels (plait.engine.compiled_kernels), which run no aten op inside and are named
    ``plait::<kernel>`` for the profiler."""
    return [e for e in events if e.name.startswith(("aten::", "plait::")) and e.self_cpu_time_total > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="sft")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--shapes", action="store_true", help="also print the top ops by their input shapes "
                        "(from the attributed step, whose times recording shapes inflates)")
    parser.add_argument("--step", type=int, default=3, help="the step timed, at least 2 (the one after it is "
                        "attributed); the ones before it warm up (the second still grows the heap)")
    options = parser.parse_args()

    import torch
    from datasets import Dataset
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer, TrainerCallback

    import plait

    sys.path.insert(0, str(HERE))
    import trl_side_by_side as sbs

    model = sbs.model_folder(None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    args = dict(output_dir="/tmp/plait-profile-step", max_steps=options.step + 1,
                per_device_train_batch_size=sbs.BATCH, logging_steps=1, save_strategy="no", report_to="none",
                learning_rate=1e-6, seed=0, bf16=options.precision == "bf16", max_length=options.length)
    args.update(sbs.method_args(options.method, options.length, groups=1))  # GKD's lmbda, GRPO's group, ...
    config = getattr(plait, f"{sbs.CONFIG[options.method]}Config")(**args)
    data = Dataset.from_list(sbs.rows(options.method, options.length, tokenizer, sbs.BATCH * (options.step + 1)))
    trainer = getattr(plait, f"{sbs.CONFIG[options.method]}Trainer")(model=model, args=config, train_dataset=data,
                                                                       processing_class=tokenizer,
                                                                       **sbs.trainer_kwargs(options.method, model))
    windows: dict[int, dict] = {}  # global step (0-based) -> its profile and seconds

    class Profiled(TrainerCallback):
        """Step ``--step``: timed, recording nothing but the ops. The step after it: Python stacks (and input shapes
        with ``--shapes``), so that each op can be attributed to a file."""

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step in (options.step - 1, options.step):
                window = windows[state.global_step] = {
                    "profile": profile(activities=[ProfilerActivity.CPU], with_stack=state.global_step == options.step,
                                       record_shapes=options.shapes and state.global_step == options.step)}
                window["profile"].__enter__()
                window["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            window = windows.get(state.global_step - 1)  # global_step has counted the step that just ended
            if window is not None and "seconds" not in window:
                window["seconds"] = time.perf_counter() - window["start"]
                window["profile"].__exit__(None, None, None)

    trainer.add_callback(Profiled())
    trainer.train()
    timed, attributed = windows[options.step - 1], windows[options.step]
    by_op: dict[str, float] = defaultdict(float)
    for event in ops(timed["profile"].events()):
        by_op[event.name] += event.self_cpu_time_total / 1e6
    stacked_ops = ops(attributed["profile"].events())
    stacked: dict[str, float] = defaultdict(float)
    for event in stacked_ops:
        stacked[event.name] += event.self_cpu_time_total / 1e6
    # each op of the stacked step is charged its share of what that op took in the timed step
    by_file: dict[str, float] = defaultdict(float)
    for event in stacked_ops:
        name = event.name
        by_file[owner(event)] += by_op.get(name, 0.0) * event.self_cpu_time_total / 1e6 / stacked[name]
    total = sum(by_op.values())
    top = lambda table: {k: round(v, 4) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:options.top]}  # noqa: E731
    result = {"date": time.strftime("%Y-%m-%d"), "method": options.method, "length": options.length,
              "precision": options.precision, "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
              "cpu": sbs.cpu_kind(), "torch_threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0],
              "step": options.step, "step_seconds": timed["seconds"], "profiled_cpu_seconds": total,
              "matmul_share": sum(by_op[k] for k in MATMUL_OPS) / total,
              "by_op_seconds": top(by_op), "by_file_seconds": top(by_file)}
    out = HERE / "results" / f"profile_{options.method}_{options.precision}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"{options.method} {options.precision}: step {timed['seconds']:.2f} s, "
          f"matmul {result['matmul_share']:.0%} of op time")
    for title, table in (("by op", result["by_op_seconds"]), ("by plait file", result["by_file_seconds"])):
        print(f"-- {title}")
        for name, seconds in table.items():
            print(f"{seconds:8.3f} s {seconds / total:6.1%}  {name}")
    if options.shapes:
        print(attributed["profile"].key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=options.top, max_name_column_width=48, max_shapes_column_width=90))


if __name__ == "__main__":
    main()
