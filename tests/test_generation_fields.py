"""TRL 1.16's generation and rollout fields of GRPOConfig, RLOOConfig and DistillationConfig, each
with its meaning: one mixin (plait.online.generation.GenerationChoice) shared by GRPO, RLOO, distillation
and PPO. The backend choice and the vLLM options are checked through the backends' own checks (no
vLLM needed); sampling options on the real transformers backend and the tiny model."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import yaml
from accelerate.utils import extract_model_from_parallel
from transformers import AutoModelForCausalLM, AutoTokenizer

import plait
from plait import cli, hookimpl, make_plugins
from plait.engine.attention import SEQUENCE_SDPA
from plait.engine.config import contributed_fields
from plait.engine.layout import check_multiple
from plait.errors import PlaitError
from plait.manager import default_plugins
from plait.online.buffer import pack, split_rows
from plait.online.generation import GenerationBackend, GenerationChoice, SamplingParams
from plait.online.importance_sampling import importance_weights
from plait.plugins.generation import transformers_backend, vllm_colocate, vllm_server
from plait.plugins.generation._vllm import vllm_sampling
from plait.plugins.methods.distill import DistillConfig, DistillTrainer
from plait.recipes.run import load_recipe, method_args
from plait.testing.tiny_model import chat_template, tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
PLAIT = Path(sys.executable).parent / "plait"
PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is")]
CHAT = [{"role": "user", "content": "What is 7 plus 5?"}]


def length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def grpo_config(**overrides) -> plait.GRPOConfig:
    values = dict(output_dir="/tmp/plait-test-generation-fields", per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=6, max_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                  disable_tqdm=True, seed=0)
    return plait.GRPOConfig(**{**values, **overrides})


def grpo(plugins=None, eval_dataset=None, **overrides) -> plait.GRPOTrainer:
    return plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=length, args=grpo_config(**overrides),
                             train_dataset=PROMPTS * 4, eval_dataset=eval_dataset, plugins=plugins)


@pytest.fixture(scope="module")
def tiny():
    path = tiny_model_path()
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


# -- which backend: generation_backend, use_vllm, vllm_mode ----------------------------------------


@pytest.mark.parametrize("fields, backend", [
    ({}, None),  # none chosen: the backend registered as the default for 'sampling'
    ({"use_vllm": True}, "vllm_colocate"),
    ({"use_vllm": True, "vllm_mode": "server"}, "vllm_server"),
    ({"vllm_mode": "server"}, None),  # vllm_mode matters only with use_vllm, as in TRL
    ({"generation_backend": "vllm_server"}, "vllm_server"),
    ({"use_vllm": True, "vllm_mode": "server", "generation_backend": "generation.vllm_server"}, "generation.vllm_server"),
])
def test_one_backend_name_from_generation_backend_use_vllm_and_vllm_mode(fields, backend):
    for config in (plait.GRPOConfig, plait.RLOOConfig, DistillConfig):
        assert config(output_dir="/tmp/x", report_to=[], **fields).params.backend_name() == backend


def test_conflicting_backend_settings_are_one_line():
    with pytest.raises(PlaitError) as err:
        grpo_config(generation_backend="transformers", use_vllm=True)
    message = str(err.value)
    assert "\n" not in message
    assert "generation_backend='transformers' conflicts with use_vllm=True" in message and "'vllm_colocate'" in message
    with pytest.raises(PlaitError, match="vllm_mode='remote' must be one of colocate, server"):
        grpo_config(use_vllm=True, vllm_mode="remote")


def test_a_recipe_and_the_plait_command_resolve_use_vllm_to_the_server_backend(tmp_path):
    recipe = yaml.safe_load((ROOT / "examples/recipes/grpo_tiny.yaml").read_text())
    recipe["model"] = str(tiny_model_path())
    recipe["dataset"]["data_files"] = str(ROOT / "examples/data/demo_preferences.jsonl")
    recipe["training"].update(use_vllm=True, vllm_mode="server", vllm_server_port=8123)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    _, args = method_args(load_recipe(tmp_path / "recipe.yaml", method="grpo"), default_plugins())
    assert args.params.backend_name() == "vllm_server"
    assert vllm_server.check_config(args).server_port == 8123

    command = ["grpo", "--config", str(ROOT / "examples/recipes/grpo_tiny.yaml"), "--model", str(tiny_model_path()),
               "--output_dir", str(tmp_path / "out"), "--check"]
    ok = subprocess.run([str(PLAIT), *command, "--use_vllm", "true", "--vllm_mode", "server"], capture_output=True,
                        text=True, timeout=300)  # once through the installed script; the refusals through its main()
    assert ok.returncode == 0, ok.stderr

    def refused(*flags) -> str:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert cli.main([*command, *flags]) == 2
        return err.getvalue()

    # the server backend's own check ran on the resolved name: its port rule speaks (the colocate one has no port)
    assert "generation.vllm_server: vllm_server_port=70000 must be a port number" in refused(
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_port", "70000")
    assert "conflicts with use_vllm=True" in refused("--use_vllm", "true", "--generation_backend", "transformers")


# -- the vLLM fields are config fields that reach the backends' options (no vLLM needed) -----------


def test_vllm_fields_default_to_the_backends_defaults_and_reach_them():
    defaults = grpo_config()
    assert (defaults.vllm_model_impl, defaults.vllm_server_host) == ("auto", "127.0.0.1")  # docs/trl-differences.md
    assert vllm_colocate.check_config(defaults) == vllm_colocate.VLLMColocateParams()
    assert vllm_server.check_config(defaults) == vllm_server.VLLMServerParams()
    args = grpo_config(vllm_gpu_memory_utilization=0.5, vllm_tensor_parallel_size=2, vllm_max_model_length=256,
                       vllm_model_impl="transformers", vllm_dtype="float32", vllm_kv_cache_memory_bytes=2**26,
                       vllm_enable_prefix_caching=False, vllm_engine_kwargs={"enforce_eager": True}, vllm_seed=3,
                       vllm_enforce_eager=False, vllm_server_base_url="http://10.0.0.5:9000", vllm_server_host="10.0.0.5", vllm_server_port=9000,
                       vllm_server_timeout=5.0, vllm_group_port=51300, vllm_server_token="secret")
    assert vllm_colocate.check_config(args) == vllm_colocate.VLLMColocateParams(
        gpu_memory_utilization=0.5, tensor_parallel_size=2, max_model_length=256, model_impl="transformers",
        dtype="float32", kv_cache_memory_bytes=2**26, enable_prefix_caching=False, engine_kwargs={"enforce_eager": True},
        seed=3, enforce_eager=False)
    assert vllm_server.check_config(args) == vllm_server.VLLMServerParams(
        server_base_url="http://10.0.0.5:9000", server_host="10.0.0.5", server_port=9000, server_timeout=5.0,
        group_port=51300, server_token="secret")
    assert "secret" not in str(args.to_dict())  # a *_token field is redacted where the config is logged


def test_a_bad_vllm_option_fails_before_the_model_loads():
    with pytest.raises(PlaitError, match="generation.vllm_colocate: .*gpu_memory_utilization=2.0"):
        plait.GRPOTrainer("/nonexistent/model", reward_funcs=length,
                          args=grpo_config(use_vllm=True, vllm_gpu_memory_utilization=2.0))
    with pytest.raises(PlaitError, match="use_transformers_continuous_batching=True applies to generation.transformers"):
        plait.GRPOTrainer("/nonexistent/model", reward_funcs=length,
                          args=grpo_config(use_vllm=True, use_transformers_continuous_batching=True))


def test_vllm_sampling_maps_top_k_0_to_all_tokens():
    class FakeVLLM:  # vLLM is not installed here: its SamplingParams is a record of the options
        SamplingParams = dict

    assert vllm_sampling(FakeVLLM, SamplingParams(top_k=0))["top_k"] == 0
    assert vllm_sampling(FakeVLLM, SamplingParams(top_k=None))["top_k"] == 0
    assert vllm_sampling(FakeVLLM, SamplingParams(top_k=5))["top_k"] == 5


def test_vllm_structured_outputs_regex_becomes_guided_decoding():
    vllm = pytest.importorskip("vllm")
    params = vllm_sampling(vllm, grpo_config(vllm_structured_outputs_regex=r"\d+").params.sampling())
    assert params.structured_outputs.regex == r"\d+"


def test_the_transformers_backend_refuses_a_regex(tiny):
    with pytest.raises(PlaitError) as err:
        plait.GRPOTrainer("/nonexistent/model", reward_funcs=length, args=grpo_config(vllm_structured_outputs_regex="a+"))
    assert "\n" not in str(err.value) and "generation.transformers cannot constrain completions to a regex" in str(err.value)
    backend = transformers_backend.TransformersBackend(*tiny)
    with pytest.raises(PlaitError, match="vllm_structured_outputs_regex='a\\+'"):
        backend.generate(["The river"], SamplingParams(structured_outputs_regex="a+"))


# -- sampling on the transformers backend ----------------------------------------------------------


def test_top_k_0_is_no_top_k_even_when_the_model_config_sets_one(tiny):
    model, tokenizer = tiny
    backend = transformers_backend.TransformersBackend(model, tokenizer)

    def sample(top_k):
        torch.manual_seed(0)
        return backend.generate(["The river"], SamplingParams(max_completion_length=8, num_generations=8,
                                                              top_k=top_k)).completion_ids

    assert grpo_config().params.top_k == 0  # TRL's default
    unfiltered = sample(None)
    assert sample(0) == unfiltered
    previous = model.generation_config.top_k
    model.generation_config.top_k = 2  # a model's own generation default must not filter plait's samples
    try:
        assert sample(0) == unfiltered
        assert sample(2) != unfiltered
    finally:
        model.generation_config.top_k = previous


def forward_inputs(model):
    """Record what each forward call of ``model`` receives (the model still runs)."""
    seen, original = [], model.forward

    def forward(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    model.forward = forward
    return seen, lambda: setattr(model, "forward", original)


def test_cache_implementation_reaches_generate(tiny):
    model, tokenizer = tiny
    caches = {}
    for cache in (None, "static"):
        backend = transformers_backend.transformers_backend(model, tokenizer, grpo_config(cache_implementation=cache))
        seen, restore = forward_inputs(model)
        try:
            greedy = backend.generate(["The river"], SamplingParams(max_completion_length=4, temperature=0.0))
        finally:
            restore()
        # transformers >= 5.20 names the forward's cache argument `cache`, 5.19 `past_key_values`
        passed = seen[-1].get("cache", seen[-1].get("past_key_values"))
        caches[cache] = (type(passed).__name__, greedy.completion_ids)
    assert caches[None][0] == "DynamicCache" and caches["static"][0] == "StaticCache"
    assert caches[None][1] == caches["static"][1]
    with pytest.raises(PlaitError, match="cache_implementation='nope': Invalid `cache_implementation`"):
        transformers_backend.check_config(grpo_config(cache_implementation="nope"))


def test_pad_to_multiple_of_pads_prompts_for_generate_and_training_tensors(tiny):
    model, tokenizer = tiny
    assert check_multiple("auto", "cpu") is None  # TRL 1.16: "auto" pads only on AWS Neuron
    assert check_multiple("auto", "neuron") == 128
    assert grpo_config(pad_to_multiple_of="none").params.pad_to_multiple_of is None  # TRL's command-line spellings
    assert grpo_config(pad_to_multiple_of="8").params.pad_to_multiple_of == 8
    with pytest.raises(PlaitError, match="pad_to_multiple_of=0 must be an integer >= 1, 'auto' or None"):
        grpo_config(pad_to_multiple_of=0)
    widths = {}
    for multiple in (None, 8):
        backend = transformers_backend.transformers_backend(model, tokenizer, grpo_config(pad_to_multiple_of=multiple))
        seen, restore = forward_inputs(model)
        try:
            out = backend.generate(["The river", "Python is"], SamplingParams(max_completion_length=4, temperature=0.0))
        finally:
            restore()
        widths[multiple] = (seen[0]["input_ids"].shape[1], out.completion_ids)
    prompt_width = max(len(tokenizer("The river")["input_ids"]), len(tokenizer("Python is")["input_ids"]))
    assert widths[None][0] == prompt_width and widths[8][0] == 8
    assert widths[None][1] == widths[8][1]  # left padding does not change what is generated
    # training tensors: prompt (left) and completion (right) widths are multiples, in every micro-batch
    batch = pack([[1, 2, 3], [4]], [[5, 6], [7, 8, 9, 10, 11]], 0, "cpu", multiple=4)
    assert batch["prompt_length"] == 4 and batch["input_ids"].shape == (2, 12)
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3, 5, 6, 0, 0, 0, 0, 0, 0], [0, 0, 0, 4, 7, 8, 9, 10, 11, 0, 0, 0]]
    assert batch["attention_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]

    def widths(multiple):  # one row per micro-batch: the 2-token and the 5-token completion
        parts = split_rows(batch, 2, torch.Generator().manual_seed(0), multiple=multiple)
        return sorted((part["input_ids"].shape[1], part["completion_mask"].shape[1]) for part in parts)

    assert widths(4) == [(8, 4), (12, 8)]
    assert widths(None) == [(6, 2), (9, 5)]


def test_pad_to_multiple_of_reaches_the_grpo_rollout():
    t = grpo(pad_to_multiple_of=16)
    out = t.rollout(t.data_collator([t.train_dataset[i] for i in range(8)]))
    assert out["prompt_length"] == 16 and out["completion_mask"].shape[1] == 16  # prompts ≤ 16, completions ≤ 6 tokens
    assert out["input_ids"].shape[1] == 32


def test_continuous_batching_runs_in_a_bf16_trainer_and_leaves_its_attention_and_precision_as_they_were():
    # A trainer puts the policy on plait_sdpa (padding-free batches) and, with bf16, wraps its forward in
    # autocast; the engine refuses plait_sdpa by name, and bf16 keys meeting its float32 cache fail every request.
    t = grpo(use_transformers_continuous_batching=True, bf16=True, max_steps=2, per_device_train_batch_size=4,
             num_generations=2)
    t.train()
    assert t.state.global_step == 2
    assert all(h["completions/mean_length"] > 0 for h in t.state.log_history if "completions/mean_length" in h)
    policy = extract_model_from_parallel(t.model_wrapped)
    assert policy.config._attn_implementation == SEQUENCE_SDPA
    assert policy.__dict__["forward"] is not policy.__dict__["_original_forward"]  # training still autocasts


def test_continuous_batching_samples_through_generate_batch(tiny):
    model, tokenizer = tiny
    args = grpo_config(use_transformers_continuous_batching=True)
    backend = transformers_backend.transformers_backend(model, tokenizer, args)
    plain = transformers_backend.TransformersBackend(model, tokenizer)
    greedy = SamplingParams(max_completion_length=6, temperature=0.0, num_generations=2)
    calls = []
    original = model.generate_batch
    model.generate_batch = lambda *a, **k: calls.append(k["continuous_batching_config"]) or original(*a, **k)
    try:
        batched = backend.generate(["The river", CHAT], greedy)
        sampled = backend.generate(["The river", CHAT], SamplingParams(max_completion_length=6, num_generations=3))
    finally:
        del model.generate_batch
    assert len(calls) == 2 and calls[0].num_blocks is not None  # on CPU the cache is sized for the call
    assert batched.completion_ids == plain.generate(["The river", CHAT], greedy).completion_ids
    assert len(sampled) == 6 and sampled.prompt_ids[:3] == [sampled.prompt_ids[0]] * 3  # grouped by prompt
    assert all(1 <= len(ids) <= 6 for ids in sampled.completion_ids)
    paged = transformers_backend.transformers_backend(model, tokenizer, grpo_config(use_transformers_paged=True))
    assert paged.continuous_batching == {}  # TRL's older name turns it on too
    with pytest.raises(PlaitError, match="repetition_penalty=1.2 is not applied by transformers' continuous batching"):
        transformers_backend.check_config(grpo_config(use_transformers_continuous_batching=True, repetition_penalty=1.2))
    with pytest.raises(PlaitError, match="transformers_continuous_batching_config=.*page_sise"):
        transformers_backend.check_config(grpo_config(use_transformers_continuous_batching=True,
                                                      transformers_continuous_batching_config={"page_sise": 8}))


# -- prompts: chat_template_kwargs -------------------------------------------------------------------

THINKING = "{%- if enable_thinking is defined and not enable_thinking -%}<think></think>{%- endif -%}"


@pytest.mark.parametrize("method", ["grpo", "distill"])
def test_chat_template_kwargs_reach_the_rendered_prompts(method):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    tokenizer.chat_template = chat_template().replace(
        "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}", "{{- '<|im_start|>assistant\\n' -}}" + THINKING + "{%- endif -%}")
    data = [{"prompt": CHAT}] * 8
    rendered = {}
    for kwargs in (None, {"enable_thinking": False}):
        if method == "grpo":
            t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=length, processing_class=tokenizer,
                                  args=grpo_config(chat_template_kwargs=kwargs), train_dataset=data)
        else:
            args = DistillConfig(output_dir="/tmp/plait-test-generation-fields", report_to=[], max_steps=1,
                                 chat_template_kwargs=kwargs, teacher_model_name_or_path=str(tiny_model_path()))
            t = DistillTrainer(str(tiny_model_path()), args=args, processing_class=tokenizer, train_dataset=data)
        rendered[bool(kwargs)] = tokenizer.decode(t.train_dataset[0]["prompt_ids"])
    assert rendered[False].endswith("<|im_start|>assistant\n")
    assert rendered[True] == rendered[False] + "<think></think>"


# -- rollouts: num_generations_eval, importance sampling bounds --------------------------------------


def test_num_generations_eval_sets_the_evaluation_groups():
    with pytest.raises(PlaitError, match="per_device_eval_batch_size 2 × 1 processes = 2 is not divisible by num_generations=4"):
        grpo(eval_dataset=PROMPTS, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2)
    t = grpo(eval_dataset=PROMPTS, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2,
             num_generations_eval=2)
    seen = []
    generate = t.backend.generate
    t.backend.generate = lambda prompts, sampling: seen.append((len(prompts), sampling.num_generations)) or \
        generate(prompts, sampling)
    metrics = t.evaluate()
    assert seen == [(1, 2)] * 4  # each evaluation batch: one prompt, two completions
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    t.train()
    assert (2, 4) in seen  # training keeps num_generations: 8 rows are 2 prompts × 4


class FixedSamplerLogprobs(GenerationBackend):
    """The transformers backend, reporting made-up sampler log-probs (-9, -7, -5, -3, ...) per token, so
    that the importance ratio π_old/π_s of the tiny model's tokens (log-prob ≈ −7) spans both bounds."""

    def __init__(self, model, processing_class, args=None):
        self.inner = transformers_backend.TransformersBackend(model, processing_class)

    def generate(self, prompts, sampling):
        out = self.inner.generate(prompts, sampling)
        logprobs = [[-9.0 + 2.0 * (t % 4) for t in range(len(ids))] for ids in out.completion_ids]
        return attrs.evolve(out, logprobs=logprobs)


class FixedSamplerPlugin:
    @hookimpl
    def register_generation_backends(self, register):
        register("generation.fixed_sampler", FixedSamplerLogprobs)


@pytest.mark.parametrize("fields, bounds", [
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.5}, (0.5, 3.0)),
    ({"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5,
      "vllm_importance_sampling_cap": 2.0}, (0.5, 2.0)),  # TRL's deprecated cap wins over clip_max
])
def test_importance_sampling_bounds_reach_the_rollout(fields, bounds):
    t = grpo(plugins=make_plugins(plugins=[FixedSamplerPlugin()]), generation_backend="fixed_sampler", **fields)
    assert t.args.params.importance_sampling_bounds() == bounds
    out = t.rollout(t.data_collator([t.train_dataset[i] for i in range(8)]))
    mask = out["completion_mask"].bool()
    sampler = torch.tensor([-9.0 + 2.0 * (i % 4) for i in range(mask.shape[1])]).expand_as(mask)
    ratio = torch.exp(out["old_logps"] - sampler)
    low, high = bounds
    if fields["vllm_importance_sampling_mode"] == "token_truncate":
        expected = ratio.clamp(low, high)
    else:
        expected = torch.where((ratio >= low) & (ratio <= high), ratio, 0.0)
    assert (ratio[mask] < low).any() and (ratio[mask] > high).any()  # both bounds are exercised
    torch.testing.assert_close(out["importance_weights"][mask], expected[mask])


def test_importance_sampling_bounds_by_hand():
    trainer_logps = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    sampler_logps = torch.log(torch.tensor([[4.0, 1.0, 0.25, 2.0]]))  # ratios 1/4, 1, 4, 1/2
    mask = torch.ones(1, 4)
    def weights(mode, cap, floor):
        return importance_weights(trainer_logps, sampler_logps, mask, mode, cap, floor)[0].tolist()

    assert weights("token_truncate", 3.0, 0.4) == pytest.approx([0.4, 1.0, 3.0, 0.5])
    assert weights("token_mask", None, 0.4) == pytest.approx([0.0, 1.0, 4.0, 0.5])
    # the sequence ratio is 1/4 · 1 · 4 · 1/2 = 1/2, below a floor of 0.6
    assert weights("sequence_mask", 3.0, 0.6) == [0.0] * 4
    assert weights("sequence_truncate", 3.0, 0.6) == pytest.approx([0.6] * 4)
    with pytest.raises(PlaitError, match="vllm_importance_sampling_clip_min=2.0 must be below vllm_importance_sampling_clip_max=2.0"):
        grpo_config(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=2.0)
    with pytest.raises(PlaitError, match="truncates the ratio but neither vllm_importance_sampling_clip_min nor"):
        grpo_config(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None)
    assert grpo_config(vllm_importance_sampling_mode="token_mask",
                       vllm_importance_sampling_clip_max=None).params.importance_sampling_bounds() == (None, None)


# -- completion logs ----------------------------------------------------------------------------------


def test_log_unique_prompts_keeps_one_row_per_prompt(capsys):
    t = grpo(log_completions=True, log_unique_prompts=True)
    texts = ["a", "b", "c", "d"]
    for unique, rows in ((True, 2), (False, 4)):
        t.args.params = attrs.evolve(t.args.params, log_unique_prompts=unique)
        t.keep_completions(["The river", "The river", "Python is", "Python is"], texts, advantage=[1.0, 2.0, 3.0, 4.0])
        t.log({"loss": 0.0})
        table = capsys.readouterr().out.splitlines()
        assert len([line for line in table if line.startswith("0 ")]) == rows, table


def test_log_completions_hub_repo_is_kept_with_one_warning(caplog):
    with pytest.raises(PlaitError, match="log_completions_hub_repo='me/completions' is set but log_completions is False"):
        grpo_config(log_completions_hub_repo="me/completions")
    with caplog.at_level(logging.WARNING, logger="plait"):
        args = grpo_config(log_completions=True, log_completions_hub_repo="me/completions")
        grpo_config(log_completions=True, log_completions_hub_repo="me/completions")
    assert args.params.log_completions_hub_repo == "me/completions"
    assert sum("nothing is pushed to the Hub" in r.message for r in caplog.records) == 1


# -- distillation: teacher_model_revision --------------------------------------------------------------


def test_teacher_model_revision_loads_that_revision(tmp_path):
    """A hub cache with two revisions of a teacher: main (the tiny model) and v2 (its output layer doubled)."""
    repo = tmp_path / "models--plait-test--teacher"
    for ref, commit in (("main", "a" * 40), ("v2", "b" * 40)):
        shutil.copytree(tiny_model_path(), repo / "snapshots" / commit)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    doubled = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with torch.no_grad():
        doubled.get_output_embeddings().weight.mul_(2.0)
    doubled.save_pretrained(repo / "snapshots" / ("b" * 40))
    heads = {}
    for revision in (None, "v2"):
        args = DistillConfig(output_dir=str(tmp_path / "out"), report_to=[], max_steps=1,
                             teacher_model_name_or_path="plait-test/teacher", teacher_model_revision=revision,
                             teacher_model_init_kwargs={"cache_dir": str(tmp_path)})
        t = DistillTrainer(str(tiny_model_path()), args=args, train_dataset=PROMPTS)
        heads[revision] = t.accelerator.unwrap_model(t.teacher).get_output_embeddings().weight.detach()
    torch.testing.assert_close(heads["v2"], 2.0 * heads[None])
    with pytest.raises(PlaitError, match="teacher_model_revision='v2' applies to a teacher loaded by name"):
        DistillTrainer(str(tiny_model_path()), teacher_model=doubled, train_dataset=PROMPTS,
                       args=DistillConfig(output_dir=str(tmp_path / "out"), report_to=[], teacher_model_revision="v2"))


# -- a third-party backend's options are Config fields, recipe keys and flags, with no edit to plait -------------

ECHO_PLUGIN = '''
import attrs
from typing import ClassVar
from plait import hookimpl
from plait.online.generation import GenerationBackend, Generations, backend_options, encode_prompts


def _at_least_one(instance, attribute, value):
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"echo_{attribute.name}={value!r} must be an integer >= 1")


@attrs.frozen
class EchoParams:
    config_prefix: ClassVar[str] = "echo_"
    repeat: int = attrs.field(default=1, validator=_at_least_one)


class Echo(GenerationBackend):
    """Answers every prompt with its last token, `repeat` times."""

    def __init__(self, processing_class, params):
        self.processing_class, self.params = processing_class, params

    def generate(self, prompts, sampling):
        ids = encode_prompts(self.processing_class, prompts)
        rows = [row for row in ids for _ in range(sampling.num_generations)]
        completions = [[row[-1]] * self.params.repeat for row in rows]
        return Generations(rows, completions, [""] * len(rows), [False] * len(rows))


def check(args):
    return backend_options(EchoParams, args, "generation.echo")


@hookimpl
def register_generation_backends(register):
    register("generation.echo", lambda model, tokenizer, args: Echo(tokenizer, check(args)), check=check,
             doc="echo the prompt's last token")
'''


def install_echo_backend(site: Path) -> None:
    """A third-party backend as pip would leave it: its module, and a dist-info naming it twice (the plugin
    in group `plait`, its options class in `plait.generation_options`)."""
    site.mkdir(parents=True)
    (site / "plait_echo.py").write_text(ECHO_PLUGIN)
    info = site / "plait_echo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plait-echo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[plait]\necho = plait_echo\n\n"
                                           "[plait.generation_options]\necho = plait_echo:EchoParams\n")


def test_a_third_party_backend_owns_its_config_fields(tmp_path):
    site = tmp_path / "site"
    install_echo_backend(site)
    env = {**os.environ, "PYTHONPATH": str(site)}

    def grpo(*flags):
        return subprocess.run([str(PLAIT), "grpo", "--config", "examples/recipes/grpo_tiny.yaml", "--model",
                               str(tiny_model_path()), "--output_dir", str(tmp_path / "out"),
                               "--generation_backend", "echo", *flags], capture_output=True, text=True, timeout=300,
                              cwd=ROOT, env=env)

    bad = grpo("--echo_repeat", "0", "--check")
    assert bad.returncode != 0 and "generation.echo: echo_repeat=0 must be an integer >= 1" in bad.stderr
    run = grpo("--echo_repeat", "3", "--max_steps", "1", "--logging_steps", "1", "--report_to", "none")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'completions/mean_length': '3'" in run.stdout + run.stderr  # the flag reached the backend's options
    python = subprocess.run([sys.executable, "-c", "import plait; print(plait.GRPOConfig(output_dir='x', "
                             "report_to='none', echo_repeat=2).echo_repeat)"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert python.stdout.strip() == "2", python.stderr[-2000:]


def test_every_generation_field_has_a_one_line_description():
    """`plait grpo --help` describes each field: the mixin's and every installed backend's (their field_help)."""
    fields = {f.name: f for f in dataclasses.fields(plait.GRPOConfig)}
    generation = [a.name for a in attrs.fields(GenerationChoice)]
    backends = list(contributed_fields(plait.GRPOConfig.params_class))
    assert "vllm_gpu_memory_utilization" in backends and "cache_implementation" in backends
    for name in generation + backends:
        text = fields[name].metadata.get("help", "")
        assert text and "\n" not in text and len(text) < 120, (name, text)
