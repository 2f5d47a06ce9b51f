"""GKD: generalised knowledge distillation, mixing the dataset's, the student's and the teacher's completions.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD), Algorithm 1. Data is SFT-style (``{prompt, completion}`` or ``{messages}``, whose
last message is the completion). For each optimizer step's batch a coin with probability ``lmbda``
decides where the completions come from: the student samples them (on-policy), otherwise the
dataset's own completions are used, or, with ``seq_kd``, the teacher samples them (sequence-level
KD, Kim & Rush 2016). Then at every completion token a ``distill.*`` loss (``distill.jsd``: the
generalised JSD with ``beta``, eq. 1) compares the student's next-token distribution with the
teacher's. As TRL 1.16's GKD, ``temperature`` is the sampling temperature; the distributions are
compared untempered.

Everything else is the on-policy distillation method's (:mod:`plait.plugins.methods.distill`):
the teacher checks, the generation backends, the loss normalised by the completion tokens of the
whole optimizer step, and :func:`plait.engine.logprobs.compare_distributions`, which never forms either
model's [B, T, V] logits. ``lmbda=1`` with ``temperature`` 1 is ``distill`` itself.
"""

from __future__ import annotations

import random
from typing import ClassVar

import attrs

from plait import Method, PlaitError, hookimpl
from plait.data.chat import tokenizer_of
from plait.data.prepare import prepare_dataset
from plait.engine.config import method_config
from plait.online.chassis import Draft, prompt_ids_of
from plait.online.generation import Generations
from plait.params import in_range, int_at_least, positive

from .distill import DistillTrainer, TeacherParams

TRANSFORMERS_BACKEND = "generation.transformers"  # the teacher samples with its own model.generate


@attrs.define
class GKDParams(TeacherParams):
    """GKD's knobs; names and defaults follow TRL 1.16's GKDConfig.

    ``lmbda`` is the fraction of batches whose completions the student samples; ``seq_kd`` makes the
    teacher sample the others (else they are the dataset's); ``max_new_tokens`` bounds every sampled
    completion; ``max_length`` bounds prompt + dataset completion (SFT's field; as TRL's GKD, longer rows keep
    their end).
    """
    field_help: ClassVar[dict[str, str]] = {
        "beta": "the divergence: 0 forward KL, 1 reverse KL, between them the generalised JSD",
        "temperature": "sampling temperature, and both models' softmax temperature in the loss",
        "lmbda": "fraction of batches whose completions the student samples (on-policy)",
        "seq_kd": "the teacher samples the other batches' completions (else they are the dataset's)",
        "max_new_tokens": "most tokens sampled per completion",
        "max_length": "most tokens of prompt + dataset completion (longer rows keep their end)",
    }

    beta: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))
    temperature: float = attrs.field(default=0.9, validator=positive)
    lmbda: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))
    seq_kd: bool = False
    max_new_tokens: int = attrs.field(default=128, validator=int_at_least(1))
    max_length: int | None = attrs.field(default=1024, validator=attrs.validators.optional(int_at_least(1)))


GKDConfig = method_config(
    "GKDConfig", GKDParams,
    defaults={"learning_rate": 2e-5, "logging_steps": 10, "remove_unused_columns": False, "disable_dropout": True},
)


def as_prompt_completion(row: dict) -> dict:
    """A ``messages`` row as prompt (every message but the last) and completion (the last one)."""
    messages = row["messages"]
    if not isinstance(messages, list) or len(messages) < 2:
        raise PlaitError(f"column 'messages' holds {messages!r:.60}; GKD needs at least a prompt message and the "
                         "completion (the last message)")
    return {"prompt": messages[:-1], "completion": messages[-1:]}


def split_at_completion(row: dict) -> dict:
    """``prompt_ids`` (the untrained start) and ``completion_ids`` (first to last trained token) of an LM row."""
    ids, mask = row["input_ids"], row["completion_mask"]
    first = mask.index(1)
    last = len(mask) - 1 - mask[::-1].index(1)
    return {"prompt_ids": ids[:first], "completion_ids": ids[first:last + 1]}


class GKDTrainer(DistillTrainer):
    """Generalised knowledge distillation: on-policy with probability ``lmbda``, else the dataset's
    (or with ``seq_kd`` the teacher's) completions, scored by composed ``distill.*`` divergences."""

    method = "gkd"
    config_class = GKDConfig
    keeps_eval_dataset_as_given = False  # TRL's GKD is an SFTTrainer: trainer.eval_dataset holds the prepared rows

    @staticmethod
    def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta: float = 0.5, temperature: float = 1.0,
                             reduction: str = "batchmean", num_items_in_batch=None):
        """TRL's helper of the same name, on whole logits ``[..., V]``: the generalised JSD of the registered
        ``distill.jsd`` (GKD eq. 1; β = 0 forward KL, β = 1 reverse KL) at each position, both softmaxes at
        ``temperature``, positions whose label is -100 left out; then summed and divided by
        ``num_items_in_batch`` when given, else reduced: "batchmean" (per kept position; without labels, per row
        of the first dimension, as TRL's), "sum", "mean"
        (per position and vocabulary entry, as an elementwise mean), "none" (one value per kept position)."""
        import torch

        from plait.engine.batches import TokenDistributions
        from plait.manager import default_plugins

        jsd = default_plugins().losses.get("distill.jsd", family="distill")
        vocab = student_logits.shape[-1]
        student = torch.log_softmax(student_logits.float() / temperature, -1).reshape(-1, vocab)
        teacher = torch.log_softmax(teacher_logits.float() / temperature, -1).reshape(-1, vocab)
        if labels is not None:
            kept = labels.reshape(-1) != -100
            student, teacher = student[kept], teacher[kept]
        divergence = jsd.obj(TokenDistributions(student, teacher), jsd.make_params(beta=beta))
        if num_items_in_batch is not None:
            return divergence.sum() / torch.as_tensor(num_items_in_batch, device=divergence.device)
        rows = max(divergence.numel(), 1) if labels is not None else student_logits.shape[0]  # TRL's batchmean
        reductions = {"batchmean": lambda d: d.sum() / rows, "sum": torch.sum,
                      "mean": lambda d: d.sum() / max(d.numel() * vocab, 1), "none": lambda d: d}
        if reduction not in reductions:
            raise PlaitError(f"reduction={reduction!r}: use one of {', '.join(reductions)}")
        return reductions[reduction](divergence)
    @staticmethod
    def generate_on_policy_outputs(model, inputs, generation_config):
        """TRL's helper: ``model.generate`` after the left-padded ``inputs["prompts"]`` (``prompt_attention_mask``),
        returning the sequences, their attention mask (the prompt's, then each completion up to and including its
        first EOS of ``generation_config``; all of it without an EOS id) and labels (the sequences, -100 on the
        prompt and wherever the mask is 0)."""
        import torch

        prompts, prompt_mask = inputs["prompts"], inputs["prompt_attention_mask"]
        sequences = model.generate(input_ids=prompts, attention_mask=prompt_mask, generation_config=generation_config,
                                   return_dict_in_generate=True).sequences
        completions = sequences[:, prompts.shape[1]:]
        kept = torch.ones_like(completions)
        if generation_config.eos_token_id is not None:
            stops = torch.isin(completions, torch.tensor(generation_config.eos_token_id, device=completions.device))
            kept = ((stops.cumsum(dim=1) - stops.long()) == 0).to(sequences.dtype)  # no EOS before this token
        attention_mask = torch.cat([prompt_mask.to(sequences.dtype), kept], dim=1)
        labels = sequences.masked_fill(attention_mask == 0, -100)
        labels[:, :prompts.shape[1]] = -100
        return sequences, attention_mask, labels

    teacher_backend = None

    # -- data: SFT-style rows become prompt ids + the dataset's completion ids ------------------
    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        import datasets

        if isinstance(dataset, list):
            dataset = datasets.Dataset.from_list(dataset)
        columns = dataset.column_names
        if "messages" in columns and "prompt" not in columns:
            dataset = dataset.map(as_prompt_completion, remove_columns=["messages"], desc="plait: GKD prompts")
        elif not {"prompt", "completion"} <= set(columns):
            raise PlaitError(f"GKD's {split} dataset has columns {columns}; give SFT-style rows: {{prompt, completion}} "
                             "or {messages} (the last message is the completion)")
        p = args.params
        dataset = dataset.add_column("gkd_prompt", list(dataset["prompt"]))
        encoded = prepare_dataset(dataset, processing_class, "language_modeling", plugins=self.plugins,
                                  max_length=p.max_length, truncation_mode="keep_end", completion_only_loss=True,
                                  num_proc=p.dataset_num_proc,
                                  chat_template_kwargs=p.chat_template_kwargs)
        encoded = encoded.map(split_at_completion, remove_columns=["input_ids", "completion_mask"])
        return encoded.rename_column("gkd_prompt", "prompt")

    # -- where a batch's completions come from -------------------------------------------------
    def completion_source(self) -> str:
        """``"student"`` with probability ``lmbda``, else ``"teacher"`` (``seq_kd``) or ``"dataset"``.

        One draw per optimizer step, from (seed, step): every process agrees and a resumed run
        draws the same coins. Evaluation scores the dataset's completions."""
        p = self.args.params
        if not self.model.training:
            return "dataset"
        if random.Random(f"{self.args.seed}:{self.state.global_step}").random() < p.lmbda:
            return "student"
        return "teacher" if p.seq_kd else "dataset"

    def sampling_params(self):
        p = self.args.params
        return p.sampling(p.max_new_tokens, p.temperature)

    def loss_temperature(self) -> float:
        return 1.0  # TRL 1.16's GKD tempers sampling only

    def after_init(self) -> None:
        super().after_init()
        p = self.args.params
        if p.seq_kd and p.lmbda < 1.0:
            factory = self.plugins.generation_backends.get(TRANSFORMERS_BACKEND).obj
            self.teacher_backend = factory(self.teacher, self.processing_class, self.args)

    def sample(self, inputs: dict) -> Draft:
        """Completions from the student (the backend), the teacher or the dataset, as the coin says."""
        source = self.completion_source()
        if source == "student":
            draft = super().sample(inputs)
        else:
            prompt_ids = prompt_ids_of(inputs)
            if source == "teacher":
                generations = self.teacher_backend.generate(prompt_ids, self.sampling_params())
            else:
                completion_ids = [list(ids) for ids in inputs["completion_ids"]]
                texts = tokenizer_of(self.processing_class).batch_decode(completion_ids, skip_special_tokens=True)
                generations = Generations(prompt_ids, completion_ids, texts, [True] * len(completion_ids))
            draft = self.sampled(inputs, prompt_ids, generations)
        self.record({"on_policy": float(source == "student")})
        return draft


@hookimpl
def register_methods(register):
    register("method.gkd", Method(config=GKDConfig, trainer=GKDTrainer, loss_family="distill",
                                  summary="Generalised knowledge distillation: lmbda mixes on-policy and dataset/teacher "
                                          "completions, distill.* divergences"))
