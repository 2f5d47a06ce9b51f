"""Asynchronous GRPO: a rollout worker generates while the trainer trains (TRL's ``AsyncGRPOTrainer``).

Synchronous GRPO alternates: sample a generation batch, then train on it. Here a *rollout worker*
keeps sampling the next generation batches from the latest weights it was sent while the trainer
takes optimizer steps on the batches it already has (the pipelining of Noukhovitch et al. 2024,
"Asynchronous RLHF", §3). The losses, rewards, advantages and buffer are GRPO's
(:class:`plait.plugins.methods.grpo.GRPOTrainer`); only where the completions come from changes.

**Staleness.** A sample's *version* v is the number of optimizer steps of the weights that generated
it; the trainer at step s trains on it with staleness s − v. Generation batch i is consumed at step
d_i = ⌊i · steps_per_generation · num_iterations / gradient_accumulation_steps⌋ (exact, so also after
a resume), and the worker does not start it before it holds weights of version ≥ d_i − ``max_staleness``.
A batch that still arrives older than that (or sampled for other prompts than the data loader handed
out) is dropped, regenerated from the current weights and counted (``async/dropped_batches``).
``max_staleness=0`` is synchronous GRPO with a worker. The trainer pushes its weights to the worker
every ``weight_sync_steps`` optimizer steps, so ``weight_sync_steps`` ≤ ``max_staleness`` + 1.

**Correction.** The worker returns the sampler's log-probs of every completion token, so the
trainer's importance-sampling correction (:mod:`plait.online.importance_sampling`, TRL's
``vllm_importance_sampling_*`` fields) weights each stale sample by π_θ(y)/π_v(y), bounded and
truncated or masked as configured, and the clip ratio is taken against the current policy.

**Workers.** With ``generation.transformers`` (the default) the worker is a separate process
(``torch.multiprocessing`` spawn) holding a copy of the policy (PEFT adapters merged); pushes copy the
weights into shared memory, which the worker reads before its next batch, so generation truly runs
beside the training step. A backend holding its own weights (``generation.vllm_server``: ``plait
vllm-serve`` in its own process) is driven from a thread of the trainer through the same interface,
its weights pushed with the backend's own ``load_weights``. ``vllm_mode='colocate'`` is refused (its
engine shares the trainer's process and device), as in TRL. One training process only.

The worker stops when ``train()`` returns or raises (Ctrl-C included); the worker process ignores
SIGINT, and exits by itself if the trainer's process disappears.

Metrics per generation batch: ``async/staleness``, ``async/weight_version``, ``async/dropped_batches``
(so far), ``async/wait_seconds`` (the trainer blocked on the worker) and ``async/generation_seconds``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import signal
import threading
import time
import traceback
from typing import ClassVar

import attrs
import torch
from accelerate.utils import extract_model_from_parallel
from transformers import TrainerCallback

from plait import Method, PlaitError, hookimpl
from plait.engine.config import method_config
from plait.engine.logprobs import token_logprobs
from plait.online.buffer import completion_columns, pack, whole_groups
from plait.online.chassis import Draft, prompt_ids_of
from plait.online.generation import Generations, SamplingParams
from plait.online.weights import full_tensor, policy_parameters
from plait.params import int_at_least

from .grpo import GRPOParams, GRPOTrainer

logger = logging.getLogger("plait")


@attrs.define
class AsyncGRPOParams(GRPOParams):
    """GRPO's knobs plus the rollout pipeline's, named as in TRL 1.16's AsyncGRPOConfig
    (``trl.experimental.async_grpo``), with its defaults (``max_completion_length`` 2048 too).

    ``max_staleness``: optimizer steps a sample may lag behind the weights it trains (older ones
    are dropped and regenerated). ``weight_sync_steps``: optimizer steps between weight pushes to the
    worker. ``max_inflight_tasks``: completions requested from the worker ahead of the trainer (−1,
    TRL's rule: ``max_staleness`` optimizer steps' worth, at least one generation batch);
    ``queue_maxsize`` caps them too. ``request_timeout``: seconds the trainer waits for one generation
    batch, ``weight_sync_timeout``: seconds a weight push may wait for the worker, before either
    gives up naming the worker.
    """
    field_help: ClassVar[dict[str, str]] = {
        "max_completion_length": "most tokens sampled per completion",
        "max_staleness": "optimizer steps a sample may lag behind the weights it trains (older ones are regenerated)",
        "weight_sync_steps": "optimizer steps between weight pushes to the rollout worker",
        "max_inflight_tasks": "completions requested ahead of the trainer (-1: max_staleness steps' worth)",
        "queue_maxsize": "most finished rollouts waiting for the trainer",
        "request_timeout": "seconds the trainer waits for one generation batch",
        "weight_sync_timeout": "seconds a weight push may wait for the worker",
    }

    max_completion_length: int = attrs.field(default=2048, validator=int_at_least(1))
    max_staleness: int = attrs.field(default=4, validator=int_at_least(0))
    weight_sync_steps: int = attrs.field(default=1, validator=int_at_least(1))
    max_inflight_tasks: int = attrs.field(default=-1, validator=int_at_least(-1))
    queue_maxsize: int = attrs.field(default=1024, validator=int_at_least(1))
    request_timeout: float = attrs.field(default=600, validator=attrs.validators.gt(0))
    weight_sync_timeout: float = attrs.field(default=1800, validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.weight_sync_steps > self.max_staleness + 1:
            raise PlaitError(f"AsyncGRPOConfig: weight_sync_steps={self.weight_sync_steps} pushes weights more "
                             f"rarely than max_staleness={self.max_staleness} allows (every sample would be stale); "
                             f"set weight_sync_steps <= {self.max_staleness + 1} or raise max_staleness")
        if self.max_inflight_tasks == 0:
            raise PlaitError("AsyncGRPOConfig: max_inflight_tasks=0 requests nothing from the rollout worker; "
                             "use -1 (auto) or a number of completions >= 1")
        if self.backend_name() in ("vllm_colocate", "generation.vllm_colocate"):
            raise PlaitError("AsyncGRPOConfig: vllm_mode='colocate' runs the engine in the trainer's process, so "
                             "generation cannot overlap training; use vllm_mode='server' (plait vllm-serve) or the "
                             "transformers backend (use_vllm=False)")


AsyncGRPOConfig = method_config(
    "AsyncGRPOConfig", AsyncGRPOParams,
    defaults={"learning_rate": 1e-6, "logging_steps": 1, "remove_unused_columns": False},
)


# ---------------------------------------------------------------------------------------------
# Rollout workers: submit(job) ahead, take(index) in order, push(model, version), close()
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Job:
    """Generation batch ``index``: ``prompts`` (token ids) sampled with ``sampling`` from weights of
    version ≥ ``min_version``, the RNG seeded with ``seed``."""

    index: int
    prompts: list[list[int]]
    sampling: SamplingParams
    min_version: int
    seed: int


@attrs.frozen
class Result:
    index: int
    version: int
    generations: Generations
    prompts: list[list[int]]
    seconds: float


class RolloutWorker:
    """What the trainer needs of a worker; ``exclusive()`` guards the trainer's own use of the backend."""

    def submit(self, job: Job) -> None:
        raise NotImplementedError

    def take(self, index: int, timeout: float) -> Result:
        raise NotImplementedError

    def push(self, model, version: int, timeout: float | None = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def exclusive(self):
        return contextlib.nullcontext()

    def _stashed(self, index: int) -> Result | None:
        return self.results.pop(index, None)


def _copy_weights(model, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The policy's weights under the base model's names (PEFT adapters merged) copied ``into`` the
    given CPU tensors, or into new ones."""
    out = {} if into is None else into
    with torch.no_grad(), policy_parameters(model) as named:
        for name, param in named:
            with full_tensor(param) as tensor:
                if into is None:
                    out[name] = tensor.detach().to("cpu", copy=True)
                else:
                    out[name].copy_(tensor)
    return out


def _base_config(model):
    model = extract_model_from_parallel(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


class ProcessWorker(RolloutWorker):
    """A spawned process that samples with ``generation.transformers`` on its own copy of the policy.

    The weights live in shared memory (one CPU copy); :meth:`push` overwrites them under a lock and
    bumps the version, and the worker copies them into its model before the next batch it starts.
    """

    def __init__(self, model, processing_class, options: dict, temperature: float, threads: int):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.shared = {name: tensor.share_memory_() for name, tensor in _copy_weights(model).items()}
        self.version = ctx.Value("q", -1, lock=False)
        self.condition = ctx.Condition()
        self.stop = ctx.Event()
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        self.results: dict[int, Result] = {}
        self.process = ctx.Process(
            target=_serve, name="plait-rollout-worker", daemon=True,
            args=(_base_config(model), self.shared, self.version, self.condition, self.stop, self.requests,
                  self.replies, processing_class, options, temperature, threads))
        with _main_not_reimported():
            self.process.start()

    def push(self, model, version: int, timeout: float | None = None) -> None:
        if not self.condition.acquire(timeout=timeout):
            raise PlaitError(f"the rollout worker held its weights for more than weight_sync_timeout={timeout:g} s; "
                             "raise weight_sync_timeout")
        try:
            _copy_weights(model, into=self.shared)
            self.version.value = version
            self.condition.notify_all()
        finally:
            self.condition.release()

    def submit(self, job: Job) -> None:
        self.requests.put(job)

    def take(self, index: int, timeout: float) -> Result:
        deadline = time.monotonic() + timeout
        while (result := self._stashed(index)) is None:
            try:
                reply = self.replies.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if not self.process.is_alive():
                    raise PlaitError(f"the rollout worker process exited (code {self.process.exitcode}) before "
                                     f"generation batch {index} came back") from None
                if time.monotonic() > deadline:
                    raise PlaitError(f"the rollout worker returned no generation batch {index} within {timeout:g} s; "
                                     "raise request_timeout or make generation batches smaller") from None
                continue
            if isinstance(reply, str):  # the worker's traceback
                raise PlaitError(f"the rollout worker failed: {reply.strip().splitlines()[-1]}\n{reply}")
            self.results[reply.index] = reply
        return result

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(Exception):
            self.requests.put(None)
        with contextlib.suppress(Exception), self.condition:
            self.condition.notify_all()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        for q in (self.requests, self.replies):
            q.cancel_join_thread()
            q.close()
        self.results.clear()


@contextlib.contextmanager
def _main_not_reimported():
    """Spawn runs the parent's main script again in the child unless it has no file or spec: the
    worker needs nothing from it, and a training script without a ``__main__`` guard would train twice."""
    import sys

    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _serve(config, shared, version, condition, stop, requests, replies, processing_class, options, temperature,
           threads) -> None:
    """The worker process: build the model, then serve jobs until ``None``, ``stop`` or an orphaned parent."""
    import multiprocessing

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops us
    torch.set_num_threads(threads)
    parent = multiprocessing.parent_process()

    def running() -> bool:
        return not stop.is_set() and (parent is None or parent.is_alive())

    try:
        from transformers import AutoModelForCausalLM

        from plait.engine.logprobs import token_logprobs
        from plait.plugins.generation.transformers_backend import TransformersBackend

        dtype = next(iter(shared.values())).dtype
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        params = dict(model.named_parameters())
        backend = TransformersBackend(model, processing_class, **options)
        mine = -1
        while running():
            try:
                job = requests.get(timeout=1.0)
            except queue.Empty:
                continue
            if job is None:
                break
            with condition:
                while version.value < max(job.min_version, 0) and running():  # -1: nothing pushed yet
                    condition.wait(timeout=1.0)
                if not running():
                    break
                if version.value != mine:
                    with torch.no_grad():
                        for name, tensor in shared.items():
                            params[name].copy_(tensor)
                    mine = version.value
            start = time.perf_counter()
            torch.manual_seed(job.seed)
            out = backend.generate(job.prompts, job.sampling)
            out = attrs.evolve(out, logprobs=_sampled_logprobs(model, out, backend.pad_id, temperature, token_logprobs))
            replies.put(Result(job.index, mine, out, job.prompts, time.perf_counter() - start))
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
        replies.put(traceback.format_exc())


@torch.no_grad()
def _sampled_logprobs(model, out: Generations, pad_id: int, temperature: float, token_logprobs,
                      device: torch.device | str = "cpu") -> list[list[float]]:
    """The sampler's log-prob of each completion token, by the trainer's own log-prob path."""
    batch = pack(out.prompt_ids, out.completion_ids, pad_id, device)
    width = batch["prompt_length"]
    logps = token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature=temperature,
                           select=completion_columns(batch["input_ids"], width)).logps[:, width:].float()
    return [row[:len(ids)].tolist() for row, ids in zip(logps, out.completion_ids)]


class ThreadWorker(RolloutWorker):
    """Drives a backend that holds its own weights (``generation.vllm_server``) from a thread.

    Generation and weight pushes take one lock: a push waits for the batch being generated (the
    server then holds the new weights for every later batch)."""

    def __init__(self, backend):
        self.backend = backend
        self.lock = threading.Condition()
        self.version = -1
        self.jobs: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.results: dict[int, Result] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="plait-rollout-worker", daemon=True)
        self.thread.start()

    def exclusive(self):
        return self.lock

    def push(self, model, version: int, timeout: float | None = None) -> None:
        if not self.lock.acquire(timeout=-1 if timeout is None else timeout):
            raise PlaitError(f"the rollout worker generated for more than weight_sync_timeout={timeout:g} s while a "
                             "weight push waited; raise weight_sync_timeout or make generation batches smaller")
        try:
            self.backend.load_weights(model)
            self.version = version
            self.lock.notify_all()
        finally:
            self.lock.release()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def _serve(self) -> None:
        try:
            while not self.stopping.is_set():
                job = self.jobs.get()
                if job is None:
                    return
                with self.lock:
                    while self.version < job.min_version and not self.stopping.is_set():
                        self.lock.wait(timeout=1.0)
                    if self.stopping.is_set():
                        return
                    start = time.perf_counter()
                    torch.manual_seed(job.seed)
                    out = self.backend.generate(job.prompts, job.sampling)
                    self.replies.put(Result(job.index, self.version, out, job.prompts, time.perf_counter() - start))
        except BaseException:  # noqa: BLE001 - raised in the trainer's thread
            self.replies.put(traceback.format_exc())

    def take(self, index: int, timeout: float) -> Result:
        deadline = time.monotonic() + timeout
        while (result := self._stashed(index)) is None:
            try:
                reply = self.replies.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise PlaitError(f"the rollout worker returned no generation batch {index} within {timeout:g} s; "
                                 "raise request_timeout or make generation batches smaller") from None
            if isinstance(reply, str):
                raise PlaitError(f"the rollout worker failed: {reply.strip().splitlines()[-1]}\n{reply}")
            self.results[reply.index] = reply
        return result

    def close(self) -> None:
        self.stopping.set()
        self.jobs.put(None)
        with self.lock:
            self.lock.notify_all()
        self.thread.join(timeout=30)
        self.results.clear()


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


class _PushWeights(TrainerCallback):
    """After every ``weight_sync_steps``-th optimizer step the trainer's weights go to the worker."""

    def __init__(self, trainer: "AsyncGRPOTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer.worker is not None and state.global_step % args.params.weight_sync_steps == 0:
            start = time.perf_counter()
            trainer.worker.push(trainer.model_wrapped, state.global_step, args.params.weight_sync_timeout)
            trainer.push_seconds.append(time.perf_counter() - start)


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO whose generation batches come from a rollout worker running beside the training steps."""

    method = "async_grpo"
    config_class = AsyncGRPOConfig
    takes_images = False  # the rollout worker samples from token ids only

    def validate(self, args) -> None:
        super().validate(args)
        if self.agent is not None:  # the worker samples single turns; continuing an episode needs the live policy
            raise PlaitError("AsyncGRPOTrainer samples one turn per completion in its rollout worker, so tools, "
                             "environment and rollout_func (multi-turn episodes) are not supported; use GRPOTrainer")
        if args.params.skip_dropped_prompts is not None:  # its worker picks the prompts before their history is in
            raise PlaitError(f"skip_dropped_prompts={args.params.skip_dropped_prompts}: AsyncGRPOTrainer's worker samples "
                             "each batch's prompts ahead, before the filters' verdicts on them are known; drop "
                             "skip_dropped_prompts or use GRPOTrainer")
        if args.world_size > 1:
            raise PlaitError(f"AsyncGRPOTrainer runs on one training process (this run has {args.world_size}); "
                             "launch one process, or use GRPOTrainer for data-parallel training")

    def after_init(self) -> None:
        super().after_init()
        self.worker: RolloutWorker | None = None
        self.dropped_batches = 0
        self.consumed: list[dict] = []  # per generation batch: index, step, version (the staleness record)
        self.push_seconds: list[float] = []
        self._submitted = -1
        self._epoch_order: tuple[int, list[int]] | None = None
        self.add_callback(_PushWeights(self))

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_worker()

    def close_worker(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.close()

    # -- the worker ---------------------------------------------------------------------------
    def start_worker(self) -> RolloutWorker:
        p = self.args.params
        if self.backend.shares_weights:  # it samples with the policy itself: give a process its own copy
            backend = self.backend
            options = dict(max_batch_size=backend.max_batch_size, cache_implementation=backend.cache_implementation,
                           pad_to_multiple_of=backend.pad_to_multiple_of, continuous_batching=backend.continuous_batching)
            threads = max(1, torch.get_num_threads() // 2)
            worker = ProcessWorker(self.model_wrapped, self.processing_class, options, p.temperature, threads)
        else:
            worker = ThreadWorker(self.backend)
        self.worker = worker
        worker.push(self.model_wrapped, self.state.global_step, p.weight_sync_timeout)
        return worker

    def refuse_on_stream(self, args) -> str | None:
        return ("AsyncGRPOTrainer's worker samples the prompts of batches ahead by their index, which a stream has "
                "not; load the dataset whole, or train with GRPOTrainer")

    @property
    def in_flight(self) -> int:
        """Generation batches requested ahead of the one being trained on."""
        p, args, total = self.args.params, self.args, self.sizes.total
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        wanted = p.max_staleness * per_step if p.max_inflight_tasks < 0 else p.max_inflight_tasks
        return max(1, min(math.ceil(wanted / total), p.queue_maxsize // total))

    def due_step(self, index: int) -> int:
        """The optimizer step (global_step) at which generation batch ``index`` is trained on."""
        return index * self.buffer.per_rollout // self.args.gradient_accumulation_steps

    def predicted_prompts(self, index: int) -> list[list[int]]:
        """The prompt ids the data loader will hand out for generation batch ``index`` (its sampler is
        seeded per epoch), so the worker can sample them before the trainer asks."""
        sizes, rows_per_batch = self.sizes, self.sizes.local * self.buffer.per_rollout
        per_epoch = len(self.train_dataset) // sizes.prompts
        epoch, position = divmod(index, per_epoch)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            sampler = self._get_train_sampler()
            sampler.set_epoch(epoch)
            self._epoch_order = (epoch, list(sampler))
        rows = self._epoch_order[1][position * rows_per_batch:position * rows_per_batch + sizes.local]
        return prompt_ids_of(self.data_collator([self.train_dataset[k] for k in rows]))

    def _job(self, index: int, prompt_ids: list[list[int]], min_version: int) -> Job:
        g = self.group_size
        sampling = self.args.params.sampling()
        if whole_groups(prompt_ids, g):
            prompt_ids, sampling = prompt_ids[::g], attrs.evolve(sampling, num_generations=g)
        return Job(index, prompt_ids, sampling, min_version, seed=self.args.seed + index)

    def _fill(self, index: int) -> None:
        """Keep generation batches ``index`` .. ``index + in_flight`` requested."""
        for ahead in range(max(self._submitted + 1, index), index + self.in_flight + 1):
            self.worker.submit(self._job(ahead, self.predicted_prompts(ahead),
                                         self.due_step(ahead) - self.args.params.max_staleness))
            self._submitted = ahead

    def sample(self, inputs: dict) -> Draft:
        """The generation batch the worker sampled for these prompts (regenerated when too stale)."""
        if not self.model.training:  # evaluation samples in the trainer, from the current weights
            return self.sample_here(inputs)
        prompt_ids = prompt_ids_of(inputs)
        p, step = self.args.params, self.state.global_step
        index = self.buffer.step // self.buffer.per_rollout
        if self.worker is None:
            self.start_worker()
            self._submitted = index - 1
        self._fill(index)
        start = time.perf_counter()
        result = self.worker.take(index, p.request_timeout)
        expected = self._job(index, prompt_ids, 0).prompts
        if result.prompts != expected or step - result.version > p.max_staleness:
            # stale or sampled for other prompts: drop it, and sample these prompts from the current weights
            self.dropped_batches += 1
            if result.version < step:
                self.worker.push(self.model_wrapped, step, p.weight_sync_timeout)
            self.worker.submit(self._job(index, prompt_ids, step))
            result = self.worker.take(index, p.request_timeout)
        waited = time.perf_counter() - start
        self.consumed.append({"index": index, "step": step, "version": result.version})
        self.record({"async/staleness": step - result.version, "async/weight_version": result.version,
                     "async/dropped_batches": self.dropped_batches, "async/wait_seconds": waited,
                     "async/generation_seconds": result.seconds})
        if result.generations.logprobs is None:
            _warn_no_logprobs()
        return self.sampled(inputs, prompt_ids, result.generations)

    def sample_here(self, inputs: dict) -> Draft:
        """These prompts sampled in the trainer from its current weights, the worker's backend held meanwhile."""
        with self.worker.exclusive() if self.worker is not None else contextlib.nullcontext():
            return super().sample(inputs)

    def sample_refill(self, inputs: dict) -> Draft:
        """A refill round of dynamic sampling (:meth:`~plait.online.chassis.OnlineTrainer.filter_groups`),
        sampled here from the current weights, as evaluation is: its prompts leave the refill stream only
        once this batch is scored, so the worker has none ahead, and queued behind batches that wait for
        later weights it would wait for this very step. Its log-probs are the current policy's, so the
        importance weight of a fresh refill is 1."""
        p, step = self.args.params, self.state.global_step
        if not self.backend.shares_weights:  # the server samples with this step's weights, pushed as the worker's are
            self.worker.push(self.model_wrapped, step, p.weight_sync_timeout)
            self._synced_step = step
        draft = self.sample_here(inputs)
        if draft.generations.logprobs is None:
            model = self.accelerator.unwrap_model(self.model)
            logprobs = _sampled_logprobs(model, draft.generations, self.backend.pad_id, p.temperature, token_logprobs,
                                         self.accelerator.device)
            draft.generations = attrs.evolve(draft.generations, logprobs=logprobs)
        return draft

    # -- resume -------------------------------------------------------------------------------
    def resume_state(self) -> dict:
        return {**super().resume_state(), "async": {"dropped_batches": self.dropped_batches}}

    def load_resume_state(self, state: dict) -> None:
        super().load_resume_state(state)
        self.dropped_batches = state.get("async", {}).get("dropped_batches", 0)


_warned: list[bool] = []


def _warn_no_logprobs() -> None:
    if not _warned:
        _warned.append(True)
        logger.warning("plait: the generation backend reports no log-probs, so stale samples are not "
                       "importance-weighted; use generation.transformers or generation.vllm_server")


@hookimpl
def register_methods(register):
    register("method.async_grpo", Method(config=AsyncGRPOConfig, trainer=AsyncGRPOTrainer, loss_family="grpo",
                                         summary="GRPO with a rollout worker generating beside the training steps"))
