"""Every hook a plait plugin can implement: the whole extension surface in one module.

A plugin is any module or object with functions decorated by ``plait.hookimpl`` whose names
match the specs below; it is found through the ``plait`` entry-point group. Built-ins in
``plait.plugins``, ``plait.losses`` and ``plait.rewards`` use exactly this surface.

Three families of hooks:

* **Registration** hooks receive a ``register`` callback. Call it once per component:
  ``register(name, obj, params=AttrsClass, doc="one line", **options)``. The core owns storage,
  records which distribution registered each name and rejects duplicates. Each hook is marked with
  its :class:`Kind` (``@registration``): what one entry is called and the attrs class of the
  ``options`` it accepts, validated when it registers. That mark is the one place a kind is
  declared; the manager, the catalog and ``plait list`` read :func:`kinds`.
* **Dispatch** hooks (``firstresult``) answer "who handles this input?": the first non-None
  answer wins, so a third-party plugin can teach plait a new data shape or reward source.
* **Lifecycle** hooks are broadcast to every plugin at fixed points of a run.

pluggy only passes a hook the arguments it names, so implementations may declare a subset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import attrs
import pluggy
from attrs.validators import deep_iterable, in_, instance_of, is_callable, optional

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerCallback

PROJECT = "plait"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]


# ---------------------------------------------------------------------------------------------
# Kinds: each registration hook, what its entries are called and the options they may declare
# ---------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Options:
    """The options one component was registered with, typed per kind (no options: this class).

    Read them as attributes (``component.options.consumes``); an option left unset is its default.
    """

    def declared(self) -> dict[str, Any]:
        """The options that differ from their defaults: what the plugin declared."""
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self)) if getattr(self, f.name) != f.default}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and attrs.astuple(self, recurse=False) == attrs.astuple(other, recurse=False)

    def __hash__(self) -> int:  # values may be unhashable (a list of columns): equal options share the class
        return hash(type(self))


def flag(default: bool = False) -> Any:
    """A yes/no option: a bool, nothing else (``"no"`` would be true)."""
    return attrs.field(default=default, validator=instance_of(bool))


@attrs.frozen(eq=False)  # Options' equality and hash: values may be unhashable
class LossOptions(Options):
    """What a loss declares: the batch it reads, its output's shape, and properties methods and the kit rely on.

    ``metrics``: ``(batch, params) -> {name: tensor}``, what the loss adds to its family's logged metrics,
    computed from the same batch (one value per example, or already reduced). The method logs the mean
    of each (:meth:`plait.engine.objective.Objective.metrics`), and of its family's default metrics
    (DPO's and CPO's rewards/* and logps/*, KTO's kl, GRPO's entropy and clip fractions) under every name
    no loss gives (the first composed loss to give a name wins). A loss that declares none logs its
    family's default and, when composed with others, its value as ``loss/<name>``.
    """

    consumes: type | None = attrs.field(default=None, validator=optional(instance_of(type)))
    output: str | None = attrs.field(default=None, validator=optional(in_(("example", "token", "scalar"))))
    reduces: bool = flag()  # the older spelling of output="scalar"
    monotone: str | None = attrs.field(default=None, validator=optional(in_(("non_increasing_in_margin",))))
    batch_coupled: bool = flag()
    f_divergence: bool = flag()
    sorts_batch: bool = flag()
    metrics: Callable | None = attrs.field(default=None, validator=optional(is_callable()))
    cpo_alpha: float | None = attrs.field(default=None, validator=optional(instance_of((int, float))))

    @property
    def reduction(self) -> str:
        """``example`` ([B]), ``token`` ([B, T]) or ``scalar`` (already reduced)."""
        return self.output or ("scalar" if self.reduces else "example")


@attrs.frozen(eq=False)  # Options' equality and hash: values may be unhashable
class RewardOptions(Options):
    """What a reward reads: text or conversational completions, and the dataset columns it needs."""

    completion_format: str = attrs.field(default="text", validator=in_(("text", "messages", "any")))
    columns: tuple = attrs.field(default=(), validator=deep_iterable(instance_of(str), instance_of((tuple, list))))


@attrs.frozen(eq=False)  # Options' equality and hash: values may be unhashable
class AdvantageOptions(Options):
    """Properties of an estimator's output the kit checks and methods read."""

    zero_mean_per_group: bool = flag()
    token_level: bool = flag()  # advantages [N, T] (from values and per-token rewards), not [N]
    turn_level: bool = flag()  # one advantage per model turn of a multi-turn episode (Rollout.turn_rewards), [N, T]
    group_relative: bool | None = attrs.field(default=None, validator=optional(instance_of(bool)))

    @property
    def is_group_relative(self) -> bool:
        """Whether an all-equal group gets zeros (by default: unless it is token-level)."""
        return not self.token_level if self.group_relative is None else self.group_relative


@attrs.frozen(eq=False)  # Options' equality and hash: values may be unhashable
class BackendOptions(Options):
    """``check(config)``: refuses a run's config before any weights load; ``images``: takes image inputs."""

    check: Callable | None = attrs.field(default=None, validator=optional(is_callable()))
    images: bool = flag()


@attrs.frozen(eq=False)  # Options' equality and hash: values may be unhashable
class PackingOptions(Options):
    """``padding_free``: each packed row holds whole documents, so their lengths can be passed on."""

    padding_free: bool = flag()


@attrs.frozen(eq=False)  # Options' equality and hash: values may be unhashable
class EnvironmentOptions(Options):
    """``owns_reward=False``: the environment never scores an episode (rewards do)."""

    owns_reward: bool = flag(True)


@attrs.frozen(eq=False)  # Options' equality and hash: values may be unhashable
class ChatTemplateOptions(Options):
    """How a model's own chat template is recognised: every string of ``recognises`` appears in it and none of
    ``unless`` does, or, for a test strings cannot state (a hash), ``matches(template) -> bool``."""

    recognises: tuple = attrs.field(default=(), validator=deep_iterable(instance_of(str), instance_of((tuple, list))))
    unless: tuple = attrs.field(default=(), validator=deep_iterable(instance_of(str), instance_of((tuple, list))))
    matches: Callable | None = attrs.field(default=None, validator=optional(is_callable()))

    def recognise(self, template: str) -> bool:
        """Whether ``template`` (a tokenizer's own chat template) is this entry's family's."""
        if self.matches is not None:
            return bool(self.matches(template))
        return bool(self.recognises) and all(s in template for s in self.recognises) and not any(
            s in template for s in self.unless)


@attrs.frozen
class Kind:
    """One kind of component, declared by marking its registration hook with :func:`registration`."""

    name: str  # the hook's suffix and the registry's name: "losses"
    singular: str  # one entry, in messages: "loss"
    options: type  # the Options class of what ``register(..., **options)`` accepts
    listed_as: str  # `plait list <listed_as>`


def registration(singular: str, options: type = Options, listed_as: str | None = None) -> Callable:
    """Mark a ``register_<kinds>`` hookspec with its :class:`Kind`."""

    def mark(spec: Callable) -> Callable:
        name = spec.__name__.removeprefix("register_")
        spec.kind = Kind(name, singular, options, listed_as or name)
        return hookspec(spec)

    return mark


def kinds() -> dict[str, Kind]:
    """Every kind, from the marked registration hooks of this module, in the order they are declared."""
    return {spec.kind.name: spec.kind for spec in globals().values() if isinstance(getattr(spec, "kind", None), Kind)}


# ---------------------------------------------------------------------------------------------
# Registration: methods and their building blocks
# ---------------------------------------------------------------------------------------------


@registration("method")
def register_methods(register: Register) -> None:
    """Register training methods (``method.sft``, ``method.dpo``, ``method.grpo``, ...).

    ``obj`` is a :class:`plait.Method`: its Config class (TrainingArguments + the method's
    attrs parameters), its Trainer class and the kind of loss batch it hands to losses. The
    method's CLI subcommand and its top-level names (``plait.DPOTrainer``) follow from it.
    """


@registration("loss", LossOptions)
def register_losses(register: Register) -> None:
    """Register loss functions by dotted name (``dpo.sigmoid``, ``grpo.dapo``, ``ppo.value``).

    ``obj`` is a pure function ``(batch, params) -> Tensor`` returning one loss per example,
    shape ``[B]`` (``[B, T]`` with ``output="token"``, or a scalar for losses that normalise over
    tokens, ``output="scalar"``). ``batch`` is the typed log-prob batch named by ``consumes=`` (see
    :mod:`plait.engine.batches`); a loss never sees logits or a model. ``params`` is an instance of the
    attrs class given as ``params=``, validated at construction.
    """


@registration("reward", RewardOptions)
def register_rewards(register: Register) -> None:
    """Register reward functions by name (``reward.think_format``, ``reward.accuracy``).

    ``obj`` is called with keyword arguments ``prompts``, ``completions``, ``completion_ids``,
    ``trainer_state`` and every extra dataset column, and returns one ``float`` or ``None``
    per completion. It may be ``async``. With ``params=``, ``obj`` is a factory called with the
    params instance that returns such a function (for example ``soft_overlong(max_len=...)``).
    """


@registration("advantage estimator", AdvantageOptions, listed_as="advantages")
def register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators by name (``advantage.group``, ``advantage.rloo``, ``advantage.gae``).

    ``obj(rollout, params) -> Tensor``: ``rollout`` is a :class:`plait.engine.batches.Rollout`
    (per-reward scores ``[N, K]`` with NaN for None, weights, group size, and for token-level
    estimators values and masks); returns advantages ``[N]`` or ``[N, T]``.
    """


@registration("generation backend", BackendOptions, listed_as="backends")
def register_generation_backends(register: Register) -> None:
    """Register generation backends by name (``generation.transformers``, ``generation.vllm_colocate``).

    ``obj`` is a factory ``(model, processing_class, args) -> GenerationBackend`` (see
    :class:`plait.online.generation.GenerationBackend`): generate from token ids or messages, load new
    weights, and a start/sleep/wake/close lifecycle.
    """


@registration("data format", listed_as="formats")
def register_data_formats(register: Register) -> None:
    """Register dataset formats by name (``format.preference``, ``format.sharegpt``).

    ``obj`` is a :class:`plait.data.prepare.DataFormat`: how to recognise one example and how to
    convert it to the canonical columns the methods consume.
    """


@registration("collator")
def register_collators(register: Register) -> None:
    """Register batch collators by name (``collator.preference``, ``collator.padding_free``).

    ``obj`` is a factory ``(processing_class, **options) -> callable(list[example]) -> dict``
    of tensors (options such as ``pad_to_multiple_of`` come from the method's config).
    """


@registration("packing strategy", PackingOptions, listed_as="packing")
def register_packing_strategies(register: Register) -> None:
    """Register sequence-packing strategies (``packing.bfd``, ``packing.wrapped``).

    ``obj(lengths: list[int], max_length: int) -> list[list[tuple[int, int, int]]]``: bins of
    (example index, start, end) token slices, each bin at most ``max_length`` tokens.
    """


@registration("judge")
def register_judges(register: Register) -> None:
    """Register judges for online preference methods (``judge.reward_model``, ``judge.pairwise``).

    ``obj(prompts, completion_pairs) -> list[int]``: the index of the preferred completion of
    each pair, or -1 for a tie. With ``params=``, ``obj`` is a factory ``obj(params, plugins)``
    returning such a judge (it may load a model or resolve rewards by name through ``plugins``).
    A judge that scores each completion alone may also offer ``scores(prompts, completions, **kw)
    -> Tensor [N]``, so a method can shape the scores before comparing them.
    """


@registration("environment", EnvironmentOptions)
def register_environments(register: Register) -> None:
    """Register environments for multi-turn online RL (``env.arithmetic``), and tool-call formats
    (``env.parser.hermes``).

    An environment's ``obj`` is a factory returning a fresh :class:`plait.online.rollouts.Environment` per
    episode (``obj()``, or ``obj(params)`` with ``params=``): given a dataset row it gives the prompt,
    answers each model turn (tool results, a reply) until the episode ends, and may score it
    (``owns_reward=False`` when it never does). A parser's ``obj(text) -> (content, [ToolCall])``
    reads the tool calls out of one model turn (see :mod:`plait.online.tools`).
    """


@registration("chat template", ChatTemplateOptions, listed_as="templates")
def register_chat_templates(register: Register) -> None:
    """Register training chat templates by model family (``template.qwen3``, ``template.deepseek_r1_distill``).

    ``obj`` is a Jinja chat template (a string) with ``{% generation %}`` markers around each assistant output,
    whose rendering of a conversation extends its rendering of every earlier part of it, and which renders the
    last turn and the generation prompt as the family's own template does. Assistant-only loss uses it when a
    tokenizer's own template lacks the markers and is recognised (options ``recognises``/``unless``/``matches``),
    or when a run names it (``chat_template_path: qwen3``).
    """


@registration("rollout filter", listed_as="filters")
def register_rollout_filters(register: Register) -> None:
    """Register rollout filters by name (``filter.zero_variance``, ``filter.accuracy_band``): dynamic sampling.

    ``obj(group, params) -> bool`` keeps (True) or drops one scored group of completions of a prompt;
    ``group`` is a :class:`plait.online.filtering.RolloutGroup` (its prompt, total rewards, per-function
    scores, completion lengths and truncation flags). The online chassis refills the generation batch
    with further prompts in place of dropped groups, up to ``max_num_gen_batches`` rounds
    (:mod:`plait.online.filtering`).
    """


@registration("command")
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
