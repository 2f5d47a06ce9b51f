"""On-policy distillation: the student samples, the teacher grades every token.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD), with the student's own samples only (λ = 1). For each prompt the student
generates a completion through the configured generation backend; then, at every completion
token, a ``distill.*`` loss (``distill.jsd`` by default: β = 0 forward KL, 1 reverse KL, between
the generalised JSD) compares the student's and the teacher's next-token distributions at the
same temperature. The loss is summed over completion tokens and divided by their count over the
whole optimizer step (every micro-batch and process), so gradient accumulation is exact.

Neither model's [B, T, V] logits are formed: :func:`plait.engine.logprobs.compare_distributions` runs
both models once, captures their final hidden states and projects a chunk of positions at a time
through each model's own output layer. The teacher may be larger (another hidden size) but must
share the student's vocabulary; that is checked when the trainer is built.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch
from transformers import AutoTokenizer, PreTrainedModel

from plait import Method, PlaitError, hookimpl
from plait.data.pretrained import pretrained_kwargs
from plait.engine.batches import TokenDistributions, masked_mean
from plait.engine.config import method_config
from plait.engine.logprobs import compare_distributions
from plait.engine.models import load_model
from plait.engine.objective import Objective
from plait.online.buffer import GenerationSizes
from plait.online.chassis import Draft, RolloutParams, RolloutTrainer
from plait.params import in_range, positive


HUB_KWARGS = ("revision", "cache_dir", "local_files_only", "token")  # where the teacher's tokenizer is found too


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name}={value!r} must be an integer >= 1")


@attrs.define
class TeacherParams(RolloutParams):
    """What every student/teacher method shares (distill, GKD); names follow TRL's configs.

    ``beta`` interpolates the divergence (0 forward KL, 1 reverse KL, between the generalised
    JSD); ``temperature`` is the sampling temperature. ``loss`` composes ``distill.*`` losses as
    ``[{name, weight, **params}]`` (``beta`` is shared into every loss that takes it).
    ``teacher_model_revision`` is the hub revision (branch, tag or commit) the teacher and its
    tokenizer are loaded at.
    """
    field_help: ClassVar[dict[str, str]] = {
        "teacher_model_name_or_path": "the teacher: a local folder or hub id",
        "teacher_model_init_kwargs": "from_pretrained keyword arguments for the teacher",
        "teacher_model_revision": "the hub revision (branch, tag or commit) of the teacher",
        "beta": "the divergence: 0 forward KL, 1 reverse KL, between them the generalised JSD",
        "temperature": "sampling temperature, and both models' softmax temperature in the loss",
    }

    default_loss = "jsd"
    teacher_model_name_or_path: str | None = None
    teacher_model_init_kwargs: dict | None = None
    teacher_model_revision: str | None = None
    beta: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    temperature: float = attrs.field(default=1.0, validator=positive)


@attrs.define
class DistillParams(TeacherParams):
    """On-policy distillation's knobs (TRL's DistillationConfig): ``temperature`` applies to
    sampling and to both models' distributions in the loss."""
    field_help: ClassVar[dict[str, str]] = {
        "max_completion_length": "most tokens the student samples per completion",
    }

    max_completion_length: int = attrs.field(default=512, validator=_positive_int)


DistillConfig = method_config(
    "DistillConfig", DistillParams,
    # TRL's DistillationConfig has no router_aux_loss_coef: no load-balancing loss unless asked for
    defaults={"learning_rate": 1e-6, "logging_steps": 10, "remove_unused_columns": False, "router_aux_loss_coef": 0.0},
)


class DistillTrainer(RolloutTrainer):
    """On-policy distillation from a teacher with composable ``distill.*`` divergences."""

    method = "distill"
    config_class = DistillConfig
    prompt_collator = "collator.prompt_only"

    def __init__(self, model, teacher_model: str | PreTrainedModel | None = None, args=None, **kwargs):
        self._teacher_spec = teacher_model
        super().__init__(model, args=args, **kwargs)

    def validate(self, args) -> None:
        super().validate(args)
        p = args.params
        self.objective = Objective.build(p.loss_specs(), self.plugins.losses, family="distill",
                                         consumes=TokenDistributions, shared={"beta": p.beta})
        given = getattr(self, "_teacher_spec", None)  # validate() may run on a bare instance (recipe checks)
        if given is not None and p.teacher_model_name_or_path is not None:
            raise PlaitError("the teacher is given both as teacher_model and as teacher_model_name_or_path; give it once")
        if given is None and p.teacher_model_name_or_path is None:
            raise PlaitError("DistillTrainer needs a teacher: pass teacher_model= (a model or path) or set "
                             "teacher_model_name_or_path in the config")
        if given is not None and not isinstance(given, str) and p.teacher_model_revision is not None:
            raise PlaitError(f"teacher_model_revision={p.teacher_model_revision!r} applies to a teacher loaded by name, "
                             "but teacher_model is a loaded model; pass its path or hub id, or drop the revision")

    def rollout_plan(self, args) -> GenerationSizes:
        # one rollout per optimizer step, used once
        return GenerationSizes.one_per_prompt(args, args.gradient_accumulation_steps, 1)

    def sampling_params(self):
        p = self.args.params
        return p.sampling(p.max_completion_length, p.temperature)

    def before_peft(self, model, args, **kwargs):
        model = super().before_peft(model, args, **kwargs)
        p = args.params
        spec = self._teacher_spec if self._teacher_spec is not None else p.teacher_model_name_or_path
        # no gradients: as stored, as TRL's GKD loads it
        teacher = load_model(spec, self._teacher_kwargs(p), field="teacher_model", default_dtype="auto")
        mine, theirs = model.config.get_text_config().vocab_size, teacher.config.get_text_config().vocab_size
        if mine != theirs:
            raise PlaitError(f"teacher_model has vocab_size {theirs} but the student has {mine}; distillation compares "
                             "distributions token by token, so the teacher must share the student's tokenizer")
        teacher.eval()
        teacher.requires_grad_(False)
        self.teacher = teacher
        return model

    def after_init(self) -> None:
        super().after_init()
        self._check_same_tokenizer()
        self.teacher = self.accelerator.prepare_model(self.teacher, evaluation_mode=True)
        # Each micro-batch's loss is already divided by the optimizer step's token count.
        self.loss_is_scaled_for_ga = True

    @staticmethod
    def _teacher_kwargs(p) -> dict:
        """``teacher_model_init_kwargs`` with ``teacher_model_revision`` as the hub revision."""
        kwargs = dict(p.teacher_model_init_kwargs or {})
        if p.teacher_model_revision is not None:
            kwargs["revision"] = p.teacher_model_revision
        return kwargs

    def _check_same_tokenizer(self) -> None:
        """Equal vocabulary sizes can hide different tokenisations: compare the token tables too."""
        source = getattr(self.teacher.config, "_name_or_path", None)
        try:
            hub = {k: v for k, v in self._teacher_kwargs(self.args.params).items() if k in HUB_KWARGS}
            theirs = AutoTokenizer.from_pretrained(source, **{**pretrained_kwargs(), **hub}).get_vocab() if source else None
        except (OSError, ValueError):
            theirs = None  # no tokenizer saved with the teacher: the vocabulary sizes were checked
        mine = getattr(self.processing_class, "tokenizer", self.processing_class).get_vocab()
        if theirs is not None and theirs != mine:
            differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
            raise PlaitError(f"teacher_model {source!r} has a different tokenizer than the student (e.g. "
                             f"{differ}); distillation compares distributions token by token, so the teacher must "
                             "share the student's tokenizer")

    # -- one rollout: sampled, then graded by the teacher token by token in the loss -----------
    def estimate(self, draft: Draft) -> None:
        """The loss's normaliser: the completion tokens of the whole optimizer step, over every process."""
        tokens = draft.batch["completion_mask"].sum()
        if self.model.training:
            tokens = self.accelerator.gather(tokens.reshape(1)).sum().float() / self.accelerator.num_processes
        draft.batch["num_items"] = tokens.float().clamp(min=1.0)

    def record_rollout(self, draft: Draft) -> dict:
        self.record_lengths(draft.batch["completion_mask"], draft.finished)
        self.keep_completions(draft.prompts, draft.generations.texts)
        return draft.batch

    # -- the loss -------------------------------------------------------------------------------
    def loss_temperature(self) -> float:
        """The temperature both models' distributions are compared at (distill: the sampling one)."""
        return self.args.params.temperature

    def per_position(self, logps: torch.Tensor, teacher_logps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Weighted sum of the composed losses at each position, each part, and the student's entropy."""
        batch = TokenDistributions(logps, teacher_logps)
        parts = [term(batch) for term in self.objective.terms]
        total = sum(term.weight * part for term, part in zip(self.objective.terms, parts))
        entropy = -(logps.exp() * logps).sum(-1).detach()
        return (total, *[part.detach() for part in parts], entropy)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        width, completion_mask = inputs["prompt_length"], inputs["completion_mask"]
        select = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
        select[:, width:] = completion_mask.bool()
        total, *parts, entropy = compare_distributions(
            model, self.teacher, inputs["input_ids"], inputs["attention_mask"], fn=self.per_position, select=select,
            temperature=self.loss_temperature(), chunked=self.args.chunked_logprobs,
        )
        loss = total.sum() / inputs["num_items"]
        metrics = {"entropy": masked_mean(entropy, select), "divergence": masked_mean(total.detach(), select)}
        if len(parts) > 1:
            metrics.update({f"loss/{term.name}": masked_mean(part, select)
                            for term, part in zip(self.objective.terms, parts)})
        self.record(metrics)
        return (loss, None) if return_outputs else loss


@hookimpl
def register_methods(register):
    register("method.distill", Method(config=DistillConfig, trainer=DistillTrainer, loss_family="distill",
                                      summary="On-policy distillation from a teacher with distill.* divergences (GKD)",
                                      exports={"DistillationConfig": DistillConfig, "DistillationTrainer": DistillTrainer}))
