"""``generation.transformers``: sample with the training model itself through ``model.generate``.

No second copy of the weights and nothing to push after an optimizer step: the backend holds
the trainer's model and unwraps it at each call (DDP/accelerate wrappers share their module's
parameters; a PEFT model generates with its adapters on). Prompts are left-padded into one
batch; each row stops at an EOS token, and the tokens sampled after it (padding) are cut off,
so completion ids come back without padding. Dropout is off while sampling and the model's
training mode is restored afterwards.
"""

from __future__ import annotations

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import GenerationConfig

from plait import hookimpl
from plait.chat import tokenizer_of
from plait.errors import PlaitError
from plait.generation import GenerationBackend, Generations, SamplingParams, encode_prompts, eos_token_ids


class TransformersBackend(GenerationBackend):
    """``model.generate`` on the policy; ``max_batch_size`` rows per call bound the KV cache."""

    shares_weights = True

    def __init__(self, model, processing_class, max_batch_size: int | None = None):
        self.model = model
        self.processing_class = processing_class
        self.max_batch_size = max_batch_size
        tokenizer = tokenizer_of(processing_class)
        self.eos_ids = eos_token_ids(processing_class, extract_model_from_parallel(model))
        if not self.eos_ids:
            raise PlaitError("the tokenizer has no eos_token and the model's generation_config no eos_token_id; "
                             "set tokenizer.eos_token so completions can end")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)

    def generation_config(self, sampling: SamplingParams) -> GenerationConfig:
        greedy = sampling.temperature == 0
        options = dict(
            max_new_tokens=sampling.max_completion_length, do_sample=not greedy,
            # greedy decoding cannot return several sequences per row: rows are repeated instead
            num_return_sequences=1 if greedy else sampling.num_generations,
            repetition_penalty=sampling.repetition_penalty,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids), use_cache=True,
        )
        if not greedy:
            # top_k must be given explicitly: transformers' default would silently apply top-50.
            options.update(temperature=sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k or 0, min_p=sampling.min_p)
        return GenerationConfig(**{**options, **sampling.generation_kwargs})

    @torch.no_grad()
    def generate(self, prompts, sampling: SamplingParams) -> Generations:
        prompt_ids = encode_prompts(self.processing_class, prompts)
        model = extract_model_from_parallel(self.model)
        size = self.max_batch_size or len(prompt_ids)
        rows: list[list[int]] = []
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(prompt_ids), size):
                rows.extend(self._generate(model, prompt_ids[start:start + size], sampling))
        finally:
            model.train(was_training)
        completions, finished = [], []
        for row in rows:
            end = next((t for t, token in enumerate(row) if token in self.eos_ids), None)
            finished.append(end is not None)
            completions.append(row if end is None else row[: end + 1])
        texts = tokenizer_of(self.processing_class).batch_decode(completions, skip_special_tokens=True)
        repeated = [ids for ids in prompt_ids for _ in range(sampling.num_generations)]
        return Generations(prompt_ids=repeated, completion_ids=completions, texts=texts, finished=finished)

    def _generate(self, model, prompt_ids: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        if sampling.temperature == 0:
            prompt_ids = [ids for ids in prompt_ids for _ in range(sampling.num_generations)]
        device = next(model.parameters()).device
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompt_ids):  # left padding: every row's next token is at the same column
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=self.generation_config(sampling))
        return out[:, width:].tolist()


def transformers_backend(model, processing_class, args=None) -> TransformersBackend:
    """Factory registered as ``generation.transformers``; ``args.generation_max_batch_size`` if set."""
    return TransformersBackend(model, processing_class, getattr(args, "generation_max_batch_size", None))


@hookimpl
def register_generation_backends(register):
    register("generation.transformers", transformers_backend,
             doc="Sample with the policy itself via model.generate (no weight copies)")
