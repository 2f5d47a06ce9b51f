"""Every hook a plait plugin can implement: the whole extension surface in one module.

A plugin is any module or object with functions decorated by ``plait.hookimpl`` whose names
match the specs below; it is found through the ``plait`` entry-point group. Built-ins in
``plait.plugins``, ``plait.losses`` and ``plait.rewards`` use exactly this surface.

Three families of hooks:

* **Registration** hooks receive a ``register`` callback. Call it once per component:
  ``register(name, obj, params=AttrsClass, doc="one line")``. The core owns storage, records
  which distribution registered each name and rejects duplicates.
* **Dispatch** hooks (``firstresult``) answer "who handles this input?": the first non-None
  answer wins, so a third-party plugin can teach plait a new data shape or reward source.
* **Lifecycle** hooks are broadcast to every plugin at fixed points of a run.

pluggy only passes a hook the arguments it names, so implementations may declare a subset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerCallback

PROJECT = "plait"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]


# ---------------------------------------------------------------------------------------------
# Registration: methods and their building blocks
# ---------------------------------------------------------------------------------------------


@hookspec
def register_methods(register: Register) -> None:
    """Register training methods (``method.sft``, ``method.dpo``, ``method.grpo``, ...).

    ``obj`` is a :class:`plait.Method`: its Config class (TrainingArguments + the method's
    attrs parameters), its Trainer class and the kind of loss batch it hands to losses. The
    method's CLI subcommand and its top-level names (``plait.DPOTrainer``) follow from it.
    """


@hookspec
def register_losses(register: Register) -> None:
    """Register loss functions by dotted name (``dpo.sigmoid``, ``grpo.dapo``, ``ppo.value``).

    ``obj`` is a pure function ``(batch, params) -> Tensor`` returning one loss per example,
    shape ``[B]`` (or a scalar for losses that normalise over tokens, declared with
    ``reduces=True``). ``batch`` is the typed log-prob batch named by ``consumes=`` (see
    :mod:`plait.engine.batches`); a loss never sees logits or a model. ``params`` is an instance of the
    attrs class given as ``params=``, validated at construction.
    """


@hookspec
def register_rewards(register: Register) -> None:
    """Register reward functions by name (``reward.think_format``, ``reward.accuracy``).

    ``obj`` is called with keyword arguments ``prompts``, ``completions``, ``completion_ids``,
    ``trainer_state`` and every extra dataset column, and returns one ``float`` or ``None``
    per completion. It may be ``async``. With ``params=``, ``obj`` is a factory called with the
    params instance that returns such a function (for example ``soft_overlong(max_len=...)``).
    """


@hookspec
def register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators by name (``advantage.group``, ``advantage.rloo``, ``advantage.gae``).

    ``obj(rollout, params) -> Tensor``: ``rollout`` is a :class:`plait.engine.batches.Rollout`
    (per-reward scores ``[N, K]`` with NaN for None, weights, group size, and for token-level
    estimators values and masks); returns advantages ``[N]`` or ``[N, T]``.
    """


@hookspec
def register_generation_backends(register: Register) -> None:
    """Register generation backends by name (``generation.transformers``, ``generation.vllm_colocate``).

    ``obj`` is a factory ``(model, processing_class, args) -> GenerationBackend`` (see
    :class:`plait.online.generation.GenerationBackend`): generate from token ids or messages, load new
    weights, and a start/sleep/wake/close lifecycle.
    """


@hookspec
def register_data_formats(register: Register) -> None:
    """Register dataset formats by name (``format.preference``, ``format.sharegpt``).

    ``obj`` is a :class:`plait.data.prepare.DataFormat`: how to recognise one example and how to
    convert it to the canonical columns the methods consume.
    """


@hookspec
def register_collators(register: Register) -> None:
    """Register batch collators by name (``collator.preference``, ``collator.padding_free``).

    ``obj`` is a factory ``(processing_class, **options) -> callable(list[example]) -> dict``
    of tensors (options such as ``pad_to_multiple_of`` come from the method's config).
    """


@hookspec
def register_packing_strategies(register: Register) -> None:
    """Register sequence-packing strategies (``packing.bfd``, ``packing.wrapped``).

    ``obj(lengths: list[int], max_length: int) -> list[list[tuple[int, int, int]]]``: bins of
    (example index, start, end) token slices, each bin at most ``max_length`` tokens.
    """


@hookspec
def register_judges(register: Register) -> None:
    """Register judges for online preference methods (``judge.reward_model``, ``judge.pairwise``).

    ``obj(prompts, completion_pairs) -> list[int]``: the index of the preferred completion of
    each pair, or -1 for a tie. With ``params=``, ``obj`` is a factory ``obj(params, plugins)``
    returning such a judge (it may load a model or resolve rewards by name through ``plugins``).
    A judge that scores each completion alone may also offer ``scores(prompts, completions, **kw)
    -> Tensor [N]``, so a method can shape the scores before comparing them.
    """


@hookspec
def register_environments(register: Register) -> None:
    """Register environments for multi-turn online RL (``env.arithmetic``), and tool-call formats
    (``env.parser.hermes``).

    An environment's ``obj`` is a factory returning a fresh :class:`plait.online.rollouts.Environment` per
    episode (``obj()``, or ``obj(params)`` with ``params=``): given a dataset row it gives the prompt,
    answers each model turn (tool results, a reply) until the episode ends, and may score it
    (``owns_reward=False`` when it never does). A parser's ``obj(text) -> (content, [ToolCall])``
    reads the tool calls out of one model turn (see :mod:`plait.online.tools`).
    """


@hookspec
def register_commands(register: Register) -> None:
    """Register ``plait`` CLI subcommands (``command.vllm-serve`` becomes ``plait vllm-serve``).

    ``obj`` is a :class:`plait.cli.Command`: ``add_arguments(parser)`` and ``run(args, plugins) -> int``.
    """


# ---------------------------------------------------------------------------------------------
# Dispatch: first non-None answer wins
# ---------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def detect_data_format(example: Mapping[str, Any], columns: list[str]) -> str | None:
    """Name the registered data format of ``example`` (one row, with the dataset's ``columns``).

    Return ``None`` when this plugin does not recognise it. Specific shapes should answer
    before general ones; use ``@hookimpl(tryfirst=True)`` to take precedence.
    """


@hookspec(firstresult=True)
def resolve_reward(spec: Any, processing_class: Any) -> Callable[..., list[float | None]] | None:
    """Turn an entry of ``reward_funcs`` that is not a registered name into a reward function.

    ``spec`` may be a callable, a dotted import path, a model or a model path; return ``None``
    when this plugin does not handle that kind of spec.
    """


# ---------------------------------------------------------------------------------------------
# Lifecycle: broadcast to every plugin
# ---------------------------------------------------------------------------------------------


@hookspec
def trainer_callbacks(method: str, args: Any) -> list[TrainerCallback]:
    """Return transformers ``TrainerCallback`` objects to attach to a run of ``method``.

    Called once when a trainer is built; the place for logging, schedules (adaptive KL
    control), asynchronous rollout workers or weight pushes that act at step boundaries.
    """


@hookspec
def run_metadata(metadata: dict[str, Any]) -> None:
    """Add entries to ``metadata`` (written as ``plait_run.json`` beside every checkpoint)."""
