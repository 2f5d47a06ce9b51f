"""Multi-turn rollouts of online methods: tool calling, environments and custom rollout functions.

An :class:`Agent` replaces an online trainer's single ``generate`` call when the run has ``tools``,
an ``environment`` (a registered ``env.<name>``, or TRL's ``environment_factory``) or a
``rollout_func``. Each of its episodes alternates model turns (sampled through the trainer's
generation backend, whichever it is) and environment turns (tool results, an environment's
reply), and comes back as :class:`Episodes`: one row of token ids per completion, the mask of
the tokens the model sampled itself (1) against those the environment inserted (0), the
episode's messages for the reward functions and the environment's reward.

Token ids are concatenated, never re-tokenised: the model's tokens are exactly what it sampled;
an environment turn is rendered by the chat template as the text between the model's end of turn
(its EOS) and the next assistant header, so templates that wrap tool results
(``<tool_response>`` ...) are honoured. Environment tokens are context for later turns and
never in the loss: the online trainer multiplies its completion mask by the trainable mask and
carries the inserted tokens as ``tool_mask`` into :class:`plait.engine.batches.PolicyTokens`.

An environment is an :class:`Environment`: ``reset(row)`` gives the prompt (messages or text),
``step(text, calls)`` answers a model turn with messages and whether the episode is over,
``reward()`` scores it (None: the reward functions alone score). ``tools`` it lists are shown to
the model (JSON schemas in the prompt) and run by :class:`ToolEnvironment`. Episodes end when the
environment says so, after ``max_turns`` model turns (``max_tool_calling_iterations`` + 1 for
tools), when the model's turn is cut at the length budget (``max_completion_length`` counts
every token after the prompt, inserted ones too), or when the next environment turn would not fit.

Per-turn rewards (verl RFC #7244, TRL issue #4543): ``step`` may return ``Step(reward=r)``, the
reward of the model turn it answers. :class:`Episodes` record for every row the token span of
each model turn (``turn_spans``) and its reward (``turn_rewards``, None where the environment gave
none); the online trainer carries them into :class:`plait.engine.batches.Rollout` as
``turn_rewards`` ``[N, M]`` and ``turn_index`` ``[N, T]`` for turn-level advantage estimators
(``advantage.turn_return``, ``advantage.turn_gae``). An episode's return is the sum of its turn
rewards plus its episode reward (``reward()`` and the reward functions), which counts as the last
turn's: an episode without per-turn rewards is scored exactly as before, at its end. A model
turn the environment never answers (the episode ended at ``max_turns``, or the turn was cut at
the budget) has no per-turn reward.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, ClassVar, Mapping, Sequence

import attrs
import torch

from plait.data.chat import encode, is_conversational, render, render_prompt, tokenizer_of
from plait.errors import PlaitError
from plait.import_paths import import_object

from .generation import Generations
from .tools import Tool, ToolCall, call_tool, resolve_parser, resolve_tools

__all__ = ["Agent", "AgentChoice", "Environment", "Episodes", "Step", "ToolEnvironment"]


def _optional_positive(instance, attribute, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"{attribute.name}={value!r} must be a positive number of seconds or None")


@attrs.define(slots=False)  # a mixin of OnlineParams, beside GenerationChoice
class AgentChoice:
    """What makes an online method's rollouts multi-turn (all off by default).

    ``tools``: functions (or import paths ``pkg.module:func``) the model may call; their schemas
    reach the chat template as ``tools=``, calls are parsed by ``tool_call_parser`` (a registered
    ``env.parser.<name>``; None: the tokenizer's own response parser, else ``hermes``), each runs
    with ``tool_timeout`` seconds, and generation continues up to ``max_tool_calling_iterations``
    times (TRL's field; None: until the budget ends). ``environment``: a registered ``env.<name>``
    (or ``{name, **options}``) that drives each episode. ``rollout_func``: a callable or import path
    ``(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", "env_mask"?, **columns}``.
    """

    field_help: ClassVar[dict[str, str]] = {
        "tools": "functions or import paths 'pkg.module:func' the model may call during a rollout",
        "tool_call_parser": "registered parser of the model's tool calls (null: the tokenizer's own, else hermes)",
        "tool_timeout": "seconds one tool call may run (null: no limit)",
        "environment": "a registered environment by name or {name, ...options} (plait list environments)",
        "rollout_func": "a callable or import path (prompts, trainer) -> token ids and log-probs, in place of sampling",
    }

    tools: list | None = None
    tool_call_parser: str | None = None
    tool_timeout: float | None = attrs.field(default=30.0, validator=_optional_positive)
    environment: str | dict | None = None
    rollout_func: Any = None


def _turn_reward(instance, attribute, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value)):
        raise PlaitError(f"Step(reward={value!r}): a per-turn reward must be a finite number, or None for none")


@attrs.frozen
class Step:
    """An environment's turn: ``messages`` appended to the conversation (tool results, a reply), and
    whether the episode is ``done``; ``calls`` and ``failures`` count the tool calls it ran.
    ``reward`` is the per-turn reward of the model turn this step answers (None: none)."""

    messages: list[dict] = attrs.field(factory=list)
    done: bool = False
    calls: int = 0
    failures: int = 0
    reward: float | None = attrs.field(default=None, validator=_turn_reward)


class Environment:
    """One episode of a multi-turn task; a fresh instance per episode (a factory builds them).

    Subclasses override :meth:`step` (and usually :meth:`reset` and :meth:`reward`). ``tools`` are
    :class:`plait.online.tools.Tool` objects (or functions) shown to the model; ``max_turns`` caps the
    model turns of one episode (None: the method's limit)."""

    tools: Sequence[Any] = ()
    max_turns: int | None = None

    def reset(self, row: Mapping[str, Any]) -> Any:
        """The episode's prompt (messages or text) from a dataset row; the row's ``prompt`` by default."""
        return row["prompt"]

    def step(self, text: str, calls: list[ToolCall]) -> Step:
        """Answer the model's turn (its text without tool calls, and the calls it made); ``Step(reward=r)``
        gives that turn a reward of its own."""
        return Step(done=True)

    def reward(self) -> float | None:
        """The episode's reward once it is over (None: left to the reward functions)."""
        return None


class ToolEnvironment(Environment):
    """Runs the model's tool calls; the episode ends on a turn without one. Subclasses may add a
    reward or state; TRL's ``environment_factory`` instances are wrapped by :class:`FactoryEnvironment`."""

    def __init__(self, tools: Sequence[Tool] = (), timeout: float | None = 30.0):
        self.tools = list(tools)
        self.timeout = timeout

    def step(self, text: str, calls: list[ToolCall]) -> Step:
        if not calls:
            return Step(done=True)
        by_name = {tool.name: tool for tool in self.tools}
        messages, failures = [], 0
        for call in calls:
            result, failed = call_tool(by_name, call, self.timeout)
            failures += failed
            messages.append({"role": "tool", "name": call.name or "", "content": result})
        return Step(messages, done=False, calls=len(calls), failures=failures)


class FactoryEnvironment(ToolEnvironment):
    """TRL's ``environment_factory`` contract: an instance whose public methods are tools, a
    ``reset(**row)`` returning None or text appended to the last user message, and an optional
    ``get_reward()``."""

    def __init__(self, instance: Any, timeout: float | None):
        methods = [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
                   if not name.startswith("_") and name not in ("reset", "get_reward")]
        super().__init__(resolve_tools(methods, field="environment_factory tools"), timeout)
        self.instance = instance

    def reset(self, row):
        prompt = row["prompt"]
        extra = self.instance.reset(**row)
        if extra is None:
            return prompt
        if is_conversational(prompt):
            return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + extra}]
        return prompt + extra

    def reward(self):
        get = getattr(self.instance, "get_reward", None)
        return None if get is None else float(get())


@attrs.frozen(eq=False)
class Episodes(Generations):
    """:class:`plait.online.generation.Generations` of multi-turn episodes. ``trainable[i][t]`` is 1 where
    the model sampled ``completion_ids[i][t]`` and 0 where the environment inserted it;
    ``messages[i]`` the episode after its prompt (assistant, tool, ... messages) for conversational
    prompts, else None; ``rewards[i]`` the environment's reward (None: none); ``columns`` extra
    per-row values for the reward functions (a rollout_func's fields); ``stats`` per-row counts.
    ``turn_spans[i]`` are the ``(start, end)`` offsets in ``completion_ids[i]`` of each model turn and
    ``turn_rewards[i]`` its per-turn reward (None where the environment gave none); a rollout_func's
    turns are the runs of its ``env_mask``, without rewards."""

    trainable: list[list[int]] = attrs.field(factory=list)
    messages: list[list[dict]] | None = None
    rewards: list[float | None] | None = None
    columns: dict = attrs.field(factory=dict)
    stats: dict = attrs.field(factory=dict)
    turn_spans: list[list[tuple[int, int]]] = attrs.field(factory=list)
    turn_rewards: list[list[float | None]] = attrs.field(factory=list)


# ---------------------------------------------------------------------------------------------
# Rendering an environment turn
# ---------------------------------------------------------------------------------------------

_PROBE = [{"role": "user", "content": "?"},
          {"role": "assistant", "content": "", "tool_calls": [ToolCall("probe", {}).message()]}]


def turn_suffix(processing_class, messages: list[dict], template_kwargs: Mapping | None = None) -> list[int]:
    """Token ids of an environment turn as the chat template renders it after a model turn ended
    with EOS: the text after the assistant's EOS through the next assistant header."""
    tokenizer = tokenizer_of(processing_class)
    before = render(processing_class, _PROBE, template_kwargs=template_kwargs)
    after = render(processing_class, _PROBE + messages, add_generation_prompt=True, template_kwargs=template_kwargs)
    eos = tokenizer.eos_token
    cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
    if not after.startswith(before[:cut]):
        raise PlaitError("the chat template renders a conversation differently once tool messages follow (it is not "
                         "prefix-preserving), so turns cannot be appended token by token; set chat_template_path "
                         "to a template that is")
    return encode(processing_class, after[cut:], special_tokens=False)


# ---------------------------------------------------------------------------------------------
# The agent
# ---------------------------------------------------------------------------------------------


class Agent:
    """Builds each episode's environment and drives the episodes of one rollout through a trainer."""

    def __init__(self, factory: Callable[[Mapping], Environment] | None, *, max_turns: int | None,
                 parser: Callable | None, rollout_func: Callable | None = None, owns_reward: bool = False,
                 template_kwargs: Mapping | None = None, tools: Sequence[Tool] = (), parser_name: str | None = None,
                 plugins=None):
        self.factory, self.max_turns, self.parser = factory, max_turns, parser
        self.parser_name, self.plugins = parser_name, plugins
        self.rollout_func, self.owns_reward = rollout_func, owns_reward
        self.template_kwargs = dict(template_kwargs or {})
        self.tools = list(tools)

    @classmethod
    def from_params(cls, p, plugins, *, tools=None, environment_factory=None, rollout_func=None) -> "Agent | None":
        """The agent the params (or a trainer's arguments) ask for; None for plain rollouts. Everything
        a user owns is checked here, before any model loads (the tool-call parser is bound on first use)."""
        tools = _once(tools, p.tools, "tools")
        rollout_func = _once(rollout_func, p.rollout_func, "rollout_func")
        if environment_factory is not None and p.environment is not None:
            raise PlaitError(f"environment={p.environment!r} and an environment_factory are both given; give one")
        if rollout_func is not None and (tools or environment_factory is not None or p.environment is not None):
            raise PlaitError("rollout_func generates the completions itself, so tools and environments do not apply; "
                             "give rollout_func alone, or drop it")
        if rollout_func is not None:
            fn = import_object(rollout_func, "rollout_func")
            if not callable(fn):
                raise PlaitError(f"rollout_func={rollout_func!r:.60} is not callable; give a function or 'pkg.module:func'")
            return cls(None, max_turns=None, parser=None, rollout_func=fn)
        if not tools and environment_factory is None and p.environment is None:
            return None
        resolved = resolve_tools(tools)
        if p.tool_call_parser is not None:  # a misspelt format fails now
            resolve_parser(p.tool_call_parser, None, plugins)
        turns = None if p.max_tool_calling_iterations is None else p.max_tool_calling_iterations + 1
        kwargs = dict(max_turns=turns, parser=None, template_kwargs=p.chat_template_kwargs, tools=resolved,
                      parser_name=p.tool_call_parser, plugins=plugins)
        timeout = p.tool_timeout
        if environment_factory is not None:
            if not callable(environment_factory):
                raise PlaitError("environment_factory must be a callable that returns an environment instance")
            probe = environment_factory()
            if not callable(getattr(probe, "reset", None)):
                raise PlaitError(f"environment_factory built a {type(probe).__name__} without a reset method; TRL's "
                                 "contract needs reset(**row) -> str | None")
            FactoryEnvironment(probe, timeout)  # its methods' schemas are checked now

            def build(row):
                env = FactoryEnvironment(environment_factory(), timeout)
                env.tools = resolved + env.tools
                return env

            return cls(build, owns_reward=callable(getattr(probe, "get_reward", None)), **kwargs)
        if p.environment is not None:
            spec = dict(p.environment) if isinstance(p.environment, Mapping) else {"name": p.environment}
            name = str(spec.pop("name", None))
            component = plugins.environments.get(name, family="env")
            if component.params is None and spec:
                raise PlaitError(f"environment {component.name!r} takes no options; got {sorted(spec)}")
            params = component.make_params(**spec) if component.params is not None else None
            make = component.obj

            def build(row):
                env = make(params) if params is not None else make()
                own = [t if isinstance(t, Tool) else resolve_tools([t], field=f"{component.name} tools")[0]
                       for t in env.tools]
                env.tools = resolved + own
                return env

            return cls(build, owns_reward=component.options.owns_reward, **kwargs)
        return cls(lambda row: ToolEnvironment(resolved, timeout), **kwargs)

    def reward_function(self):
        """The environment's reward as a reward function (weight 1), read from the episodes' column."""
        from .scoring import RewardFunction

        def environment(environment_reward, **kwargs):
            return list(environment_reward)

        return RewardFunction("environment", environment)

    def columns(self, episodes: "Episodes") -> dict[str, list]:
        """Extra reward-function columns of a rollout: a rollout_func's fields, the environment's reward."""
        out = dict(episodes.columns)
        if self.owns_reward:
            out["environment_reward"] = episodes.rewards or [None] * len(episodes)
        return out

    # -- one rollout ----------------------------------------------------------------------------
    def run(self, trainer, prompts: list, columns: Mapping[str, list], g: int) -> Episodes:
        """The episodes of one rollout (one per row: prompts come ``g`` times in a row)."""
        if self.rollout_func is not None:
            return self._custom(trainer, prompts, g)
        if self.parser is None:
            self.parser = resolve_parser(self.parser_name, tokenizer_of(trainer.processing_class), self.plugins)
        rows = [{"prompt": prompt, **{k: v[i] for k, v in columns.items()}} for i, prompt in enumerate(prompts)]
        envs = [self.factory(row) for row in rows]
        starts = [env.reset(row) for env, row in zip(envs, rows)]
        limit = trainer.args.params.max_prompt_length
        prompt_ids = [encode_start(trainer.processing_class, start, env.tools, self.template_kwargs)
                      [-limit if limit else 0:] for start, env in zip(starts, envs)]
        episodes = drive(trainer.generate, trainer.backend, trainer.processing_class, trainer.args.params.sampling(),
                         envs, prompt_ids, starts, g, self.parser, self.max_turns, self.template_kwargs)
        self.record(trainer, episodes)
        return episodes

    def _custom(self, trainer, prompts: list, g: int) -> Episodes:
        """TRL's rollout_func: called with each prompt once (rows come ``g`` times in a row) and must
        return one completion per row; ``env_mask`` (1 model, 0 inserted) is optional, other keys
        become reward-function columns."""
        out = self.rollout_func(prompts[::g], trainer)
        missing = {"prompt_ids", "completion_ids", "logprobs"} - set(out)
        if missing:
            raise PlaitError(f"rollout_func returned no {sorted(missing)}; it must return prompt_ids, completion_ids "
                             "and logprobs (None allowed), one row per completion")
        n = len(prompts)
        completion_ids = [list(ids) for ids in out["completion_ids"]]
        prompt_ids = [list(ids) for ids in out["prompt_ids"]]
        if len(prompt_ids) == n // g and len(completion_ids) == n:
            prompt_ids = [ids for ids in prompt_ids for _ in range(g)]
        if len(completion_ids) != n or len(prompt_ids) != n:
            raise PlaitError(f"rollout_func returned {len(completion_ids)} completions for {n // g} prompts × {g} "
                             f"generations; return {n}, grouped by prompt")
        mask = out.get("env_mask") or [[1] * len(ids) for ids in completion_ids]
        eos = set(trainer.backend.eos_ids) if hasattr(trainer.backend, "eos_ids") else \
            {tokenizer_of(trainer.processing_class).eos_token_id}
        texts = tokenizer_of(trainer.processing_class).batch_decode(completion_ids, skip_special_tokens=True)
        extra = {k: list(v) for k, v in out.items() if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        spans = [_runs(row) for row in mask]
        return Episodes(prompt_ids=prompt_ids, completion_ids=completion_ids, texts=texts,
                        finished=[bool(ids) and ids[-1] in eos for ids in completion_ids],
                        logprobs=out["logprobs"], trainable=[list(m) for m in mask], columns=extra,
                        turn_spans=spans, turn_rewards=[[None] * len(row) for row in spans])

    def record(self, trainer, episodes: Episodes) -> None:
        stats = episodes.stats
        if stats:
            trainer.record({f"episodes/{name}": sum(values) / len(values) for name, values in stats.items()})

    # -- what the online trainer reads ---------------------------------------------------------
    @staticmethod
    def masks(batch: dict, episodes: Episodes) -> None:
        """Zero ``batch``'s completion mask where the environment inserted tokens; those go to ``tool_mask``."""
        mask = batch["completion_mask"]
        trainable = torch.zeros_like(mask)
        for i, row in enumerate(episodes.trainable):
            trainable[i, :len(row)] = torch.tensor(row, dtype=mask.dtype)
        batch["tool_mask"] = mask * (1 - trainable)
        batch["completion_mask"] = mask * trainable

    @staticmethod
    def turns(batch: dict, episodes: Episodes) -> None:
        """Add each completion token's model turn to ``batch`` (``turn_index`` ``[N, C]``, −1 outside every
        model turn) and each turn's reward (``turn_rewards`` ``[N, M]``, NaN where none), for
        turn-level advantage estimators and the per-turn reward metrics."""
        mask = batch["completion_mask"]
        index = torch.full(mask.shape, -1, dtype=torch.long)
        width = max([len(spans) for spans in episodes.turn_spans] + [1])
        rewards = torch.full((mask.shape[0], width), math.nan)
        for i, spans in enumerate(episodes.turn_spans):
            for k, (start, end) in enumerate(spans):
                index[i, start:end] = k
            for k, reward in enumerate(episodes.turn_rewards[i] if episodes.turn_rewards else []):
                if reward is not None:
                    rewards[i, k] = reward
        batch["turn_index"], batch["turn_rewards"] = index.to(mask.device), rewards.to(mask.device)


def encode_start(processing_class, prompt, tools: Sequence[Tool], template_kwargs: Mapping | None = None) -> list[int]:
    """Token ids of an episode's prompt: conversations rendered with the tools' schemas (``tools=``)
    and the generation prompt; text tokenised as it is (a text prompt cannot show tools)."""
    if is_conversational(prompt):
        schemas = [tool.schema for tool in tools] or None
        text = render_prompt(processing_class, list(prompt), tools=schemas, template_kwargs=template_kwargs)
        return encode(processing_class, text, special_tokens=False)
    return encode(processing_class, prompt, special_tokens=True)


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(start, end)`` spans of the runs of 1 in a trainable mask: a rollout_func's model turns."""
    spans, start = [], None
    for t, flag in enumerate(list(mask) + [0]):
        if flag and start is None:
            start = t
        elif not flag and start is not None:
            spans.append((start, t))
            start = None
    return spans


def _once(argument, field, name: str):
    if argument is not None and field is not None:
        raise PlaitError(f"{name} is given both as the trainer's argument and in the config's {name}; give it once")
    return argument if argument is not None else field


def drive(generate: Callable[[list[list[int]], int], Generations], backend, processing_class, sampling,
          envs: list[Environment], prompt_ids: list[list[int]], starts: list, g: int,
          parser: Callable[[str], tuple[str, list[ToolCall]]], max_turns: int | None,
          template_kwargs: Mapping | None = None) -> Episodes:
    """Alternate model and environment turns for every episode at once. The first model turn goes
    through ``generate(prompt_ids, g)`` (a trainer's: weight sync, one request per group), later
    ones to ``backend.generate`` with ``sampling`` (its ``max_completion_length`` is the budget of
    every token after the prompt)."""
    tokenizer = tokenizer_of(processing_class)
    budget = sampling.max_completion_length
    n = len(envs)
    ids = [[] for _ in range(n)]
    trainable = [[] for _ in range(n)]
    logprobs: list[list[float]] | None = [[] for _ in range(n)]
    messages = [[] for _ in range(n)]
    spans: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    turn_rewards: list[list[float | None]] = [[] for _ in range(n)]
    finished = [False] * n
    stats = {"turns": [0] * n, "tool_calls": [0] * n, "tool_failures": [0] * n, "truncated": [0] * n}
    limit = [env.max_turns or max_turns for env in envs]
    active = list(range(n))
    out = generate(prompt_ids, g)
    if out.logprobs is None:  # the backend reports no sampler log-probs: neither do the episodes
        logprobs = None
    while True:
        next_active = []
        for k, i in enumerate(active):
            segment = list(out.completion_ids[k])[:budget - len(ids[i])]
            done = bool(out.finished[k]) and len(segment) == len(out.completion_ids[k])
            spans[i].append((len(ids[i]), len(ids[i]) + len(segment)))
            turn_rewards[i].append(None)
            _extend(ids, trainable, logprobs, i, segment, 1, None if out.logprobs is None else out.logprobs[k])
            text = tokenizer.decode(segment, skip_special_tokens=True)
            content, calls = parser(text)
            turn = {"role": "assistant", "content": content}
            if calls:
                turn["tool_calls"] = [c.message() for c in calls if c.name is not None]
            messages[i].append(turn)
            stats["turns"][i] += 1
            finished[i] = done
            if not done:  # cut at the budget: the episode is over, truncated
                stats["truncated"][i] = 1
                continue
            if limit[i] is not None and stats["turns"][i] >= limit[i]:
                continue
            step = envs[i].step(content, calls)
            reward = getattr(step, "reward", None)
            turn_rewards[i][-1] = None if reward is None else float(reward)
            stats["tool_calls"][i] += step.calls
            stats["tool_failures"][i] += step.failures
            if step.done:
                continue
            suffix = turn_suffix(processing_class, step.messages, template_kwargs) if step.messages else []
            if len(ids[i]) + len(suffix) >= budget:  # no room for the environment's turn and a reply
                stats["truncated"][i] = 1
                continue
            messages[i].extend(step.messages)
            _extend(ids, trainable, logprobs, i, suffix, 0, None)
            next_active.append(i)
        active = next_active
        if not active:
            break
        room = max(budget - len(ids[i]) for i in active)
        out = backend.generate([prompt_ids[i] + ids[i] for i in active],
                               attrs.evolve(sampling, max_completion_length=room, num_generations=1))
    backend.sleep()
    stats["length"] = [len(row) for row in ids]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    rewards = [env.reward() for env in envs]
    return Episodes(prompt_ids=prompt_ids, completion_ids=ids, texts=texts, finished=finished,
                    logprobs=logprobs, trainable=trainable,
                    messages=messages if all(is_conversational(s) for s in starts) else None,
                    rewards=rewards if any(r is not None for r in rewards) else None, stats=stats,
                    turn_spans=spans, turn_rewards=turn_rewards)


def _extend(ids, trainable, logprobs, i: int, tokens: list[int], flag: int, scores) -> None:
    ids[i].extend(tokens)
    trainable[i].extend([flag] * len(tokens))
    if logprobs is not None:  # inserted tokens get 0.0: they are outside every mask
        logprobs[i].extend(list(scores)[:len(tokens)] if scores is not None else [0.0] * len(tokens))
