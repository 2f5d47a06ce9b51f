"""Asynchronous GRPO: the rollout worker's staleness bound, the importance weights of stale samples,
the worker's shutdown, learning, and resume on the tiny model.

Tests that spawn the worker process (``generation.transformers``) are slow-marked: each pays the
worker's start (a fresh interpreter importing torch and transformers). A backend holding its own
weights (as ``generation.vllm_server`` does) is driven from a thread; ``CopyEngine`` below is such a
backend, sampling in this process, so that path runs without vLLM.
"""

import copy
import multiprocessing

import attrs
import pytest
import torch
from accelerate.utils import extract_model_from_parallel

import plait
from plait import hookimpl
from plait.engine.logprobs import token_logprobs
from plait.errors import PlaitError
from plait.online.generation import GenerationBackend
from plait.plugins.generation.transformers_backend import TransformersBackend
from plait.plugins.methods.async_grpo import ThreadWorker, _sampled_logprobs
from plait.testing.tiny_model import tiny_model_path

PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is",
                                   "The weather today", "Numbers such as", "The children", "Nobody could")]
LOW = 100  # ids below this (~10% of the tiny vocabulary) are "rewarded"
MISSING = "/nonexistent/model"


def low_tokens(completion_ids, **kwargs):
    """A verifiable reward: the number of completion tokens with id < 100 (about 10% by chance)."""
    return [float(sum(t < LOW for t in ids)) for ids in completion_ids]


def config(**overrides):
    values = dict(output_dir="/tmp/plait-test-async-grpo", per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=6, learning_rate=1e-2, max_steps=3, logging_steps=1, report_to=[],
                  save_strategy="no", disable_tqdm=True, seed=0, max_staleness=1)
    return plait.AsyncGRPOConfig(**{**values, **overrides})


def trainer(reward_funcs=low_tokens, plugins=None, **overrides):
    return plait.AsyncGRPOTrainer(str(tiny_model_path()), reward_funcs=reward_funcs, args=config(**overrides),
                                  train_dataset=PROMPTS * 4, plugins=plugins)


@pytest.fixture(autouse=True, scope="module")
def one_thread_each():
    """The trainer and the worker process one core each (the worker takes half the trainer's threads):
    on a shared 2-core machine contended threads make every step several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def assert_within_staleness(t, bound):
    assert t.consumed, "no generation batch was consumed"
    for batch in t.consumed:  # every batch trained on was sampled at most `bound` optimizer steps earlier
        assert 0 <= batch["step"] - batch["version"] <= bound, batch
    assert [b["index"] for b in t.consumed] == list(range(t.consumed[0]["index"], t.consumed[-1]["index"] + 1))
    assert all(s <= bound for s in logged(t, "async/staleness"))


def hand_logps(model, input_ids, attention_mask, width, temperature=1.0):
    """Completion-token log-probs from one full forward and a log-softmax (not plait's chunked path)."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logps[:, width - 1:]


# -- a backend with its own weights, sampling in this process (the vLLM server's shape) ------------


class CopyEngine(GenerationBackend):
    """Holds a copy of the policy; weights arrive through load_weights, log-probs come with samples."""

    shares_weights = False

    def __init__(self, model, processing_class, args=None):
        self.copy = copy.deepcopy(extract_model_from_parallel(model)).eval()
        self.sampler = TransformersBackend(self.copy, processing_class)
        self.loads = 0

    def load_weights(self, model):
        with torch.no_grad():
            self.copy.load_state_dict(extract_model_from_parallel(model).state_dict())
        self.loads += 1

    def generate(self, prompts, sampling):
        out = self.sampler.generate(prompts, sampling)
        return attrs.evolve(out, logprobs=_sampled_logprobs(self.copy, out, self.sampler.pad_id, sampling.temperature,
                                                            token_logprobs))


class CopyEnginePlugin:
    @hookimpl
    def register_generation_backends(self, register):
        register("generation.copy_engine", CopyEngine, doc="a copy of the policy sampling in the trainer's process")


# -- configuration -----------------------------------------------------------------------------------


def test_pipeline_fields_have_trl_names_and_defaults():
    args = plait.AsyncGRPOConfig(output_dir="/tmp/plait-test-async-grpo")
    p = args.params  # TRL 1.16's trl.experimental.async_grpo.AsyncGRPOConfig defaults
    assert (p.max_staleness, p.weight_sync_steps, p.max_inflight_tasks, p.queue_maxsize, p.request_timeout,
            p.weight_sync_timeout, p.max_completion_length) == (4, 1, -1, 1024, 600, 1800, 2048)
    assert (args.learning_rate, args.logging_steps) == (1e-6, 1)
    assert isinstance(p, type(plait.GRPOConfig(output_dir="/tmp/x").params))  # every GRPO knob is there too


@pytest.mark.parametrize("overrides, message", [
    (dict(max_staleness=1, weight_sync_steps=3), "weight_sync_steps=3"),
    (dict(max_inflight_tasks=0), "max_inflight_tasks=0"),
    (dict(use_vllm=True, vllm_mode="colocate"), "vllm_mode='colocate'"),
])
def test_bad_pipeline_settings_fail_before_the_model_loads(overrides, message):
    with pytest.raises(PlaitError, match=message):
        plait.AsyncGRPOTrainer(MISSING, reward_funcs=low_tokens, args=config(**overrides), train_dataset=PROMPTS)


def test_tools_are_refused_before_the_model_loads():
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    with pytest.raises(PlaitError, match="tools, environment and rollout_func .* are not supported; use GRPOTrainer"):
        plait.AsyncGRPOTrainer(MISSING, reward_funcs=low_tokens, args=config(), train_dataset=PROMPTS, tools=[add])


def test_due_steps_and_requests_ahead_follow_the_batch_arithmetic():
    t = trainer(steps_per_generation=2, gradient_accumulation_steps=1, per_device_train_batch_size=4,
                num_iterations=2)  # one generation batch = 2 micro-batches × 2 passes = 4 optimizer steps
    assert [t.due_step(i) for i in range(3)] == [0, 4, 8]
    assert t.in_flight == 1  # max_staleness 1: one step's 4 completions ahead, at least one whole batch
    assert trainer(max_inflight_tasks=1).in_flight == 1  # fewer than one batch still asks for one
    assert trainer(max_staleness=3).in_flight == 3  # 3 steps × 8 completions = three batches of 8
    assert trainer(max_staleness=4, queue_maxsize=16).in_flight == 2  # 16 completions = two batches of 8
    loader = iter(t.get_train_dataloader())
    for index in range(3):  # the worker's prompts are the ones the data loader hands out for that batch
        batch = next(loader)
        for _ in range(t.buffer.per_rollout - 1):
            next(loader)
        ids = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
        assert t.predicted_prompts(index) == ids


# -- a backend with its own weights, driven from a thread ------------------------------------------------


def test_an_engine_with_its_own_weights_trains_within_the_staleness_bound():
    t = trainer(plugins=plait.make_plugins(plugins=[CopyEnginePlugin()]), generation_backend="generation.copy_engine",
                max_steps=4, max_staleness=1, weight_sync_steps=2)
    t.train()
    assert t.state.global_step == 4 and t.dropped_batches == 0
    assert_within_staleness(t, 1)
    assert t.backend.loads == 1 + 2  # the start, then after steps 2 and 4
    assert t.worker is None and not any(th.name == "plait-rollout-worker" and th.is_alive()
                                        for th in __import__("threading").enumerate())


def first_token_parity(completion_ids, **kwargs):
    """1 for an even first token: a group of two ties half the time, so zero_variance drops it."""
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


def test_refill_rounds_sample_from_the_weights_of_this_step():
    # Dynamic sampling: a refill round is sampled by the trainer, and an engine holding its own weights gets
    # this step's weights first, one push per refill round on top of the start and the per-step pushes.
    t = trainer(reward_funcs=first_token_parity, plugins=plait.make_plugins(plugins=[CopyEnginePlugin()]),
                generation_backend="generation.copy_engine", rollout_filters=["zero_variance"], max_num_gen_batches=3,
                per_device_train_batch_size=4, num_generations=2, max_steps=3)
    t.train()
    logs = [h for h in t.state.log_history if "rollout_filter/rounds" in h]
    refills = sum(h["rollout_filter/rounds"] - 1 for h in logs)
    assert len(logs) == 3 and refills >= 1
    assert t.backend.loads == 1 + 3 + refills
    assert all(h["frac_reward_zero_std"] == 0.0 or h["rollout_filter/padded_groups"] > 0 for h in logs)


def test_thread_worker_holds_a_batch_until_its_weights_are_new_enough():
    t = trainer(plugins=plait.make_plugins(plugins=[CopyEnginePlugin()]), generation_backend="generation.copy_engine")
    worker = ThreadWorker(t.backend)
    try:
        worker.submit(t._job(0, t.predicted_prompts(0), min_version=3))
        with pytest.raises(PlaitError, match="no generation batch 0 within 0.3 s"):
            worker.take(0, timeout=0.3)  # nothing pushed at version >= 3 yet
        worker.push(t.model, 3)
        assert worker.take(0, timeout=30).version == 3
    finally:
        worker.close()
    assert not worker.thread.is_alive()


# -- the worker process -------------------------------------------------------------------------------


@pytest.mark.slow
def test_stale_samples_are_importance_weighted_by_hand_and_too_stale_ones_dropped():
    t = trainer(max_staleness=2, vllm_importance_sampling_mode="token_truncate",
                vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    try:
        sampler = copy.deepcopy(t.model).eval()  # the weights of version 0, which the worker gets
        t.start_worker()
        with torch.no_grad():  # the trainer moves on without pushing: its samples are now one step stale
            for param in t.model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        t.state.global_step = 1
        t.model.train()
        loader = iter(t.get_train_dataloader())
        out = t.rollout(next(loader))
        assert t.consumed[-1] == {"index": 0, "step": 1, "version": 0}
        mask, width = out["completion_mask"].bool(), out["prompt_length"]
        current = t.model.eval()
        old = hand_logps(current, out["input_ids"], out["attention_mask"], width)
        sampled = hand_logps(sampler, out["input_ids"], out["attention_mask"], width)
        torch.testing.assert_close(out["sampling_logps"][mask], sampled[mask], atol=1e-4, rtol=0)
        expected = torch.exp(old - sampled).clamp(0.5, 2.0)
        assert (expected[mask] - 1).abs().max() > 0.01  # the perturbation is visible in the weights
        torch.testing.assert_close(out["importance_weights"][mask], expected[mask], atol=1e-4, rtol=1e-4)

        t.model.train()  # batch 1 was sampled from version 0 too; at step 3 it is 3 > 2 steps old
        t.state.global_step, t.buffer.step = 3, t.buffer.per_rollout
        t.rollout(next(loader))
        assert t.dropped_batches == 1 and t.consumed[-1] == {"index": 1, "step": 3, "version": 3}
    finally:
        t.close_worker()
    assert not multiprocessing.active_children()


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """30 steps on a reward that the tiny model can raise; a checkpoint at step 28 for the resume test."""
    torch.manual_seed(0)
    t = trainer(output_dir=str(tmp_path_factory.mktemp("async-grpo")), per_device_train_batch_size=16,
                num_generations=8, max_completion_length=8, max_steps=30, logging_steps=5, max_staleness=1,
                save_strategy="steps", save_steps=28)
    t.train()
    return t


@pytest.mark.slow
def test_async_grpo_raises_the_reward_within_the_staleness_bound(learned):
    rewards = logged(learned, "reward")
    print("async GRPO reward per 5 steps:", [round(r, 3) for r in rewards])
    assert rewards[0] < 1.5  # about 10% of 8 tokens by chance
    # one step off-policy learns slower than GRPO's 3x in 30 steps (test_grpo), but it learns
    assert rewards[-1] > 2 * rewards[0] and max(rewards[-2:]) > 1.2
    assert learned.state.global_step == 30 and len(learned.consumed) == 30
    assert_within_staleness(learned, 1)
    assert max(b["step"] - b["version"] for b in learned.consumed) == 1  # it did overlap
    assert learned.dropped_batches == 0  # every batch was sampled for the prompts the loader handed out


@pytest.mark.slow
def test_no_worker_process_is_left_after_train_returns_or_raises(learned):
    assert learned.worker is None and not multiprocessing.active_children()
    calls = []

    def fails_on_the_third_batch(completion_ids, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what Ctrl-C raises in the trainer's thread
        return low_tokens(completion_ids)

    t = trainer(reward_funcs=fails_on_the_third_batch, max_steps=5)
    with pytest.raises(KeyboardInterrupt):
        t.train()
    assert t.worker is None and not multiprocessing.active_children()


@pytest.mark.slow
def test_resume_continues_the_step_accounting(learned):
    resumed = trainer(output_dir=learned.args.output_dir, per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=8, max_steps=30, logging_steps=5, max_staleness=1,
                      save_strategy="steps", save_steps=28)
    resumed.train(resume_from_checkpoint=learned.args.output_dir + "/checkpoint-28")
    assert resumed.state.global_step == 30
    assert [(b["index"], b["step"]) for b in resumed.consumed] == [(28, 28), (29, 29)]
    assert_within_staleness(resumed, 1)
    assert resumed.dropped_batches == 0  # the worker sampled the prompts the resumed loader handed out
    assert resumed.worker is None and not multiprocessing.active_children()
