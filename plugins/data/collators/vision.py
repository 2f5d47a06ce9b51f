"""``collator.images``: the extra model inputs of image-bearing rows, around any other collator.

Wraps the collator a method made: the inner collator builds the token tensors as for text (the
image tokens are already in the ids, expanded when the data was tokenised), then the processor's
image processor runs once per row of the batch and the results travel as one
:class:`plait.data.vision.RowInputs` under ``batch["model_inputs"]``, aligned with the batch's rows.
A batch with ``k`` rows per example (preference: chosen rows then rejected rows) repeats the
examples' images ``k`` times in that order. ``labels`` are -100 at image tokens, whatever the
inner collator did. Rows without images get no inputs: text-only batches stay text-only.

Declared the default for ``images`` (its ``default_for``): the trainer asks for that role, not this name.
"""

from plait import hookimpl
from plait.data.vision import KEY, RowInputs, image_inputs, image_token_ids, load_images, marked_tokens
from plait.errors import PlaitError


def image_collator(processing_class, *, inner):
    """``inner`` (a collate function) with the examples' ``images`` turned into per-row model inputs."""
    wanted = sorted(image_token_ids(processing_class))

    def collate(examples):
        images = [load_images(ex.get("images")) for ex in examples]
        batch = inner(examples)  # text collators ignore the column; prompt batches keep it for rewards and logs
        if not any(images):
            return batch
        if "position_ids" in batch:
            raise PlaitError("padding_free/packing put several rows into one sequence, which image inputs cannot follow; "
                             "set padding_free=False and packing=False for image data")
        rows = batch["input_ids"].shape[0]
        if rows % len(examples):
            raise PlaitError(f"a batch of {len(examples)} image rows became {rows} sequences; image inputs follow "
                             "whole repeats of the examples only")
        per_example = tuple(image_inputs(processing_class, row) for row in images)
        batch[KEY] = RowInputs(per_example, marked_tokens(processing_class)).tile(rows // len(examples))
        if "labels" in batch and wanted:
            import torch

            batch["labels"] = batch["labels"].masked_fill(torch.isin(batch["input_ids"], torch.tensor(wanted)), -100)
        return batch

    return collate


image_collator.default_for = "images"  # the trainer asks for this role (plait.registry.Registry.default)


@hookimpl
def register_collators(register):
    register("collator.images", image_collator,
             doc="Wraps a collator: the rows' images through the image processor as per-row model inputs.")
