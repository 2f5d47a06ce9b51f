"""SFT: supervised fine-tuning on any data layout the data layer recognises.

Language-modelling text or conversations, prompt-completion pairs (the loss on the completion
only by default), assistant-only loss on conversations, packing and padding-free batches.
The loss is a composition of ``sft.*`` plugins over per-token log-probs (``sft.nll`` by
default, ``sft.dft`` for dynamic fine-tuning), normalised by the number of target tokens in the
whole accumulated batch so gradient accumulation and several processes give the same update.
"""

from __future__ import annotations

import logging
from typing import Callable, ClassVar

import attrs
import torch.nn.functional as F
from datasets import Dataset

from plait import Method, PlaitError, hookimpl
from plait.data.prepare import pack_dataset, prepare_dataset
from plait.data.vision import model_inputs as extra_model_inputs
from plait.engine.batches import TokenLogps
from plait.engine.config import method_config
from plait.engine.layout import pad_multiple_field
from plait.engine.objective import LossChoice, Objective
from plait.engine.trainer import PlaitTrainer
from plait.params import positive

logger = logging.getLogger("plait")

SKIP_PREPARE = "skip_prepare_dataset"
# TRL 1.16 keeps "chunked_nll" as a deprecated name of "nll": the same loss, computed without full
# logits. plait's log-prob path never forms full logits (plait.engine.logprobs), so the name maps to sft.nll.
LOSS_ALIASES = {"chunked_nll": "nll"}


def _dataset_kwargs(instance, attribute, value) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"dataset_kwargs={value!r} must be a mapping such as {{skip_prepare_dataset: true}} or None")
    unknown = sorted(set(value) - {SKIP_PREPARE})
    if unknown:
        raise ValueError(f"dataset_kwargs has unknown key(s) {unknown}; the only key is {SKIP_PREPARE!r} (as in TRL 1.16)")


@attrs.define
class SFTParams(LossChoice):
    """SFT's own knobs; names follow TRL's SFTConfig."""

    field_help: ClassVar[dict[str, str]] = {
        "max_length": "most tokens per example, or per row when packing; longer ones are cut (null: no limit)",
        "truncation_mode": "'keep_start' cuts the completion's end, 'keep_end' the prompt's start first",
        "packing": "pack several examples into each max_length row of the training set",
        "packing_strategy": "a registered packing strategy such as bfd (plait list packing)",
        "eval_packing": "pack the evaluation set too (null: as packing)",
        "padding_free": "examples back to back in one row, no padding",
        "pad_to_multiple_of": "round batch lengths up to this multiple (null: never; auto: 128 on AWS Neuron only)",
        "dataset_text_field": "the column read as language-modelling text",
        "dataset_kwargs": "{skip_prepare_dataset: true}: the dataset is already tokenised (input_ids)",
        "shuffle_dataset": "shuffle the dataset once when preparing it (packed rows too), with seed",
        "completion_only_loss": "train on completion tokens only (null: yes for prompt-completion data)",
        "assistant_only_loss": "train only on the assistant turns of conversations",
        "model_init_kwargs": "keyword arguments for the policy's from_pretrained (dtype, attn_implementation, ...)",
        "dataset_num_proc": "worker processes that tokenise the dataset (null: the main process only)",
    }

    default_loss = "nll"
    max_length: int | None = attrs.field(default=1024, validator=attrs.validators.optional(positive))
    truncation_mode: str = "keep_start"
    packing: bool = False
    packing_strategy: str = "bfd"
    eval_packing: bool | None = None  # None: as packing
    padding_free: bool = False
    pad_to_multiple_of: int | str | None = pad_multiple_field()
    dataset_text_field: str = "text"  # the column read as language-modelling text
    # {skip_prepare_dataset: True}: the dataset is already tokenised (input_ids, optional completion_mask or labels)
    dataset_kwargs: dict | None = attrs.field(default=None, validator=_dataset_kwargs)
    shuffle_dataset: bool = False  # shuffle once when preparing (and packed rows after packing), with args.seed
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None

    @property
    def skip_prepare_dataset(self) -> bool:
        return bool((self.dataset_kwargs or {}).get(SKIP_PREPARE))

    def packs(self, split: str) -> bool:
        """Whether the dataset of ``split`` is packed: ``packing`` for training, ``eval_packing`` (when set) otherwise."""
        return self.packing if split == "train" or self.eval_packing is None else self.eval_packing

    def loss_specs(self) -> list[dict]:
        return [{**spec, "name": LOSS_ALIASES.get(spec["name"], spec["name"])} for spec in super().loss_specs()]


SFTConfig = method_config(
    "SFTConfig", SFTParams,
    defaults={"learning_rate": 2e-5, "logging_steps": 10, "remove_unused_columns": False},
)


@attrs.frozen
class PackedOrPadded:
    """Packed rows (``seq_lengths``: several documents, positions restarting per document) go to the
    padding-free collator, others to the padded one; a class, not a closure, so data-loader workers can
    receive it."""

    flat: Callable
    padded: Callable

    def __call__(self, examples):
        return self.flat(examples) if examples[0].get("seq_lengths") is not None else self.padded(examples)


class SFTTrainer(PlaitTrainer):
    """Supervised fine-tuning with composable ``sft.*`` token losses.

    TRL 1.16's ``formatting_func`` (row -> text) makes each row the text it returns before
    tokenising, and ``compute_loss_func(outputs, labels, num_items_in_batch=)`` replaces the
    composed losses with the user's function of the model's full outputs."""

    method = "sft"
    config_class = SFTConfig
    takes_compute_loss_func = True
    takes_images = True
    formatting_func: Callable[[dict], str] | None = None

    def __init__(self, *args, formatting_func: Callable[[dict], str] | None = None, **kwargs):
        self.formatting_func = formatting_func
        super().__init__(*args, **kwargs)

    def validate(self, args) -> None:
        p = args.params
        self.objective = Objective.build(p.loss_specs(), self.plugins.losses, family="sft", consumes=TokenLogps)
        if getattr(self, "compute_loss_func", None) is not None and p.loss_specs() != [{"name": "nll"}]:
            raise PlaitError(f"compute_loss_func replaces the loss, so {p.loss_field}={getattr(p, p.loss_field)!r} "
                             f"would not be used (TRL refuses it with loss_type='dft' too); drop one of them")
        if self.formatting_func is not None:
            _check_formatting(p)
        for given in {spec["name"] for spec in LossChoice.loss_specs(p)} & set(LOSS_ALIASES):
            logger.warning("SFT: loss %r is TRL's deprecated name of %r, the same loss; using sft.%s",
                           given, LOSS_ALIASES[given], LOSS_ALIASES[given])
        if p.packing or p.eval_packing:
            self.plugins.packing_strategies.get(p.packing_strategy, family="packing")  # unknown names fail now
        self.tokens_seen = 0

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        p = args.params
        if p.skip_prepare_dataset:
            return _tokenised(dataset, split)
        prompts = None
        if self.formatting_func is not None:
            dataset, prompts = formatted(dataset, self.formatting_func, p.dataset_text_field, split)
        dataset = prepare_dataset(
            dataset, processing_class, "language_modeling", plugins=self.plugins, max_length=p.max_length,
            truncation_mode=p.truncation_mode, completion_only_loss=p.completion_only_loss,
            assistant_only_loss=p.assistant_only_loss, num_proc=p.dataset_num_proc, text_field=p.dataset_text_field,
        )
        if prompts is not None and not p.packs(split):  # LogCompletionsCallback reads them, as from TRL's datasets
            dataset = dataset.add_column("prompt", prompts)
        if p.shuffle_dataset:
            dataset = dataset.shuffle(seed=args.seed)
        if p.packs(split):
            dataset = pack_dataset(dataset, p.packing_strategy, p.max_length, plugins=self.plugins)
            if p.shuffle_dataset:  # packing orders rows by size
                dataset = dataset.shuffle(seed=args.seed)
        return dataset

    def wants_padding_free(self, args) -> bool:
        p = args.params  # packed rows hold whole documents only under a padding-free strategy (bfd)
        strategy = self.plugins.packing_strategies.get(p.packing_strategy, family="packing")
        packs = (p.packing or p.eval_packing) and strategy.options.padding_free
        return bool(p.padding_free or packs)

    def make_collator(self, processing_class, args):
        p = args.params
        flat, padded = (self.collator(name, processing_class, pad_to_multiple_of=p.pad_to_multiple_of)
                        for name in ("collator.padding_free", "collator.language_modeling"))
        return flat if p.padding_free else PackedOrPadded(flat, padded)

    def after_init(self) -> None:
        # Normalise by target tokens across accumulation steps and processes (transformers counts them).
        self.model_accepts_loss_kwargs = True

    def resume_state(self) -> dict:
        # the logged num_tokens counts every trained token of the run, so a resumed run carries it on
        return {**super().resume_state(), "num_tokens": self.tokens_seen}

    def load_resume_state(self, state: dict) -> None:
        super().load_resume_state(state)
        self.tokens_seen = state.get("num_tokens", 0)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        model_inputs = {**{k: inputs[k] for k in ("attention_mask", "position_ids") if k in inputs},
                        **extra_model_inputs(inputs)}  # a VLM's pixel_values etc. (plait.data.vision)
        mask = labels != -100
        mask[:, 0] = False  # nothing predicts a row's first token
        if self.compute_loss_func is None:
            # only the positions the loss reads go through the output layer (a completion-only or assistant-only
            # batch skips its prompts' projections and log-softmaxes); the rest come back as 0 and stay masked
            out = self.token_logprobs(model, inputs["input_ids"], with_argmax=True, select=mask, **model_inputs)
            batch = TokenLogps(out.logps, mask)
            loss, parts = self.objective(batch, mask=mask, num_tokens=num_items_in_batch)
            logged, predicted = self.objective.metrics(batch, parts), out.argmax
        else:  # the user's loss of the full outputs and the (unshifted) labels, as Trainer and TRL call it
            outputs = model(input_ids=inputs["input_ids"], use_cache=False, **model_inputs)
            loss, logged = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch), {}
            predicted = F.pad(outputs.logits[:, :-1].detach().max(-1).indices, (1, 0))  # aligned with the tokens predicted
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients; the count was global

        correct = (predicted == inputs["input_ids"]) & mask
        tokens = mask.sum()
        if self.model.training:
            self.tokens_seen += int(self.accelerator.gather_for_metrics(tokens.reshape(1)).sum())
        # the model's predictions and the tokens seen; the objective's (no default for the NLL family)
        self.record({"mean_token_accuracy": correct.sum() / tokens.clamp(min=1), "num_tokens": self.tokens_seen,
                     **logged})
        return (loss, None) if return_outputs else loss


def _check_formatting(p: SFTParams) -> None:
    """formatting_func makes each row plain text: settings that need more than text are refused."""
    if p.skip_prepare_dataset:
        raise PlaitError(f"formatting_func is given but dataset_kwargs={{'{SKIP_PREPARE}': True}} uses the dataset as "
                         "already tokenised, so it would never run; drop one of them")
    if p.completion_only_loss:  # as TRL 1.16
        raise PlaitError("formatting_func makes each row plain text, so completion_only_loss=True has no completion to "
                         "train on; format the rows into prompt/completion columns yourself, or drop completion_only_loss")
    if p.assistant_only_loss:
        raise PlaitError("formatting_func makes each row plain text, so assistant_only_loss=True has no assistant turns "
                         "to train on; drop one of them")


def formatted(dataset, formatting_func: Callable[[dict], str], text_field: str, split: str):
    """``dataset`` as TRL 1.16's ``formatting_func`` makes it: each row replaced by the text the
    function returns for it (in ``text_field``, the column tokenised), so no other column of the
    row can be read instead. Also the rows' ``prompt`` column, if they have one (None otherwise)."""
    def to_text(row: dict) -> dict:
        text = formatting_func(row)
        if not isinstance(text, str):
            raise PlaitError(f"formatting_func returned a {type(text).__name__} for a {split} row; it is called on one "
                             "row at a time (as in TRL 1.16) and must return that row's text")
        return {text_field: text}

    if isinstance(dataset, list):
        return [to_text(row) for row in dataset], [row["prompt"] for row in dataset] if "prompt" in dataset[0] else None
    columns = list(dataset.column_names or [])
    prompts = list(dataset["prompt"]) if "prompt" in columns and isinstance(dataset, Dataset) else None
    described = {"desc": f"plait: formatting_func on the {split} rows"} if isinstance(dataset, Dataset) else {}
    return dataset.map(to_text, remove_columns=columns, **described), prompts


def _tokenised(dataset, split: str):
    """A dataset given with skip_prepare_dataset, used as it is: it must hold token ids."""
    columns = dataset.column_names if hasattr(dataset, "column_names") else list(dataset[0])
    if "input_ids" not in columns:
        raise PlaitError(f"dataset_kwargs={{'{SKIP_PREPARE}': True}} takes a tokenised {split} dataset with an 'input_ids' "
                         f"column (and optionally completion_mask or labels, seq_lengths); got columns {sorted(columns)}: "
                         f"tokenise it first or drop {SKIP_PREPARE}")
    return dataset


@hookimpl
def register_methods(register):
    register("method.sft", Method(config=SFTConfig, trainer=SFTTrainer, loss_family="sft",
                                  summary="Supervised fine-tuning with composable sft.* token losses"))
