"""Image-bearing data for vision-language models: formats, token expansion, masks, truncation, collation,
and log-probs with images (the tiny Llava of plait.testing.tiny_vlm)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from plait import PlaitError, make_plugins
from plait.data.prepare import detect_format, prepare_dataset
from plait.data.vision import KEY, carry_mask, model_inputs
from plait.engine.logprobs import token_logprobs
from plait.testing.tiny_vlm import draw, shapes_dataset, tiny_qwen2_vl

N_IMAGE = 16  # 32x32 image, 8x8 patches


@pytest.fixture(scope="module")
def plugins():
    return make_plugins()


@pytest.fixture(scope="module")
def processor(tiny_vlm_path):
    return AutoProcessor.from_pretrained(tiny_vlm_path)


@pytest.fixture(scope="module")
def model(tiny_vlm_path):
    return AutoModelForImageTextToText.from_pretrained(tiny_vlm_path).eval()


def user(*parts):
    return {"role": "user", "content": list(parts)}


def answer(text):
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


IMAGE, ASK = {"type": "image"}, {"type": "text", "text": "Colour?"}
VISION_CASES = {
    "format.vision_language_modeling": {"messages": [user(IMAGE, ASK), *answer("red")]},
    "format.vision_prompt_completion": {"prompt": [user(IMAGE, ASK)], "completion": answer("red")},
    "format.vision_preference": {"prompt": [user(IMAGE, ASK)], "chosen": answer("red"), "rejected": answer("blue")},
    "format.vision_unpaired_preference": {"prompt": [user(IMAGE, ASK)], "completion": answer("red"), "label": True},
    "format.vision_prompt_only": {"prompt": [user(IMAGE, ASK)]},
}


def assert_logprobs_match(model, batch, extra, chunk_size):
    """plait's chunked log-probs with the image inputs equal the model's own forward's log-softmax, gathered."""
    with torch.no_grad():
        ours = token_logprobs(model, batch["input_ids"], batch["attention_mask"], chunk_size=chunk_size, **extra).logps
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits
    theirs = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["attention_mask"][:, 1:].bool()
    assert torch.allclose(ours[:, 1:][mask], theirs[mask], atol=1e-5)
    return ours


def image_collate(plugins, processor, inner="collator.language_modeling"):
    return plugins.collators.get("collator.images").obj(processor, inner=plugins.collators.get(inner).obj(processor))


def test_every_vision_format_is_covered(plugins):
    assert {n for n in plugins.data_formats.names() if n.startswith("format.vision_")} == set(VISION_CASES)


@pytest.mark.parametrize("name", list(VISION_CASES))
def test_image_rows_are_detected_as_their_vision_format(plugins, name):
    row = {**VISION_CASES[name], "images": [draw("circle", "red")]}
    assert detect_format([row, row], plugins).name == name
    text_only = {k: v for k, v in row.items() if k != "images"}  # image parts without images: refused, with the fix
    with pytest.raises(PlaitError, match="add an 'images' column"):
        detect_format([text_only], plugins)


def test_images_may_be_paths_and_several_per_row(processor, tmp_path):
    paths = []
    for i, colour in enumerate(("red", "blue")):
        paths.append(str(tmp_path / f"{i}.png"))
        draw("square", colour).save(paths[-1])
    row = {"prompt": [user(IMAGE, ASK, IMAGE)], "completion": answer("red"), "images": paths}
    out = prepare_dataset([row], processor, "language_modeling")[0]
    image_id = processor.image_token_id
    assert sum(t == image_id for t in out["input_ids"]) == 2 * N_IMAGE
    assert [im.size for im in out["images"]] == [(32, 32), (32, 32)]  # paths in, PIL images out


def test_image_parts_are_added_to_the_first_user_turn_when_missing(processor):
    row = {"prompt": [{"role": "user", "content": "Colour?"}], "completion": [{"role": "assistant", "content": "red"}],
           "images": [draw("circle", "red")]}
    ids = prepare_dataset([row], processor, "language_modeling")[0]["input_ids"]
    tokens = processor.tokenizer.convert_ids_to_tokens(ids)
    assert tokens.index("<image>") == 5 and tokens.count("<image>") == N_IMAGE  # right after "<|im_start|>user\n"


def test_image_tokens_and_padding_are_never_trained(processor, plugins):
    rows = shapes_dataset(2, seed=3)
    rows[1]["completion"] = answer("a much longer answer than red")
    data = prepare_dataset(rows, processor, "language_modeling", completion_only_loss=False)
    collate = image_collate(plugins, processor)
    batch = collate([data[0], data[1]])
    ids, labels = batch["input_ids"], batch["labels"]
    image = ids == processor.image_token_id
    assert int(image.sum()) == 2 * N_IMAGE
    assert (labels[image] == -100).all() and (labels[batch["attention_mask"] == 0] == -100).all()
    # everything else is trained (completion_only_loss=False): hand-check row 0 token by token
    row0 = [(t, l) for t, l, a in zip(ids[0].tolist(), labels[0].tolist(), batch["attention_mask"][0].tolist()) if a]
    assert all((l == -100) == (t == processor.image_token_id) for t, l in row0)
    pixels = model_inputs(batch)["pixel_values"]
    assert pixels.shape == (2, 3, 32, 32)


def test_assistant_only_loss_with_images_trains_the_answer_only(processor):
    rows = shapes_dataset(1, seed=5)
    row = {"messages": rows[0]["prompt"] + rows[0]["completion"], "images": rows[0]["images"]}
    out = prepare_dataset([row], processor, "language_modeling", assistant_only_loss=True)[0]
    trained = [t for t, m in zip(out["input_ids"], out["completion_mask"]) if m]
    colour = rows[0]["completion"][0]["content"][0]["text"]
    assert processor.tokenizer.decode(trained) == colour + "<|im_end|>"


def test_carry_mask_gives_inserted_tokens_zero():
    assert carry_mask([1, 9, 2, 3], [1, 9, 9, 9, 2, 3], [1, 0, 1, 1]) == [1, 0, 0, 0, 1, 1]
    with pytest.raises(PlaitError):
        carry_mask([1, 2], [1, 3], [1, 1])


def test_truncation_never_cuts_an_image(processor, caplog):
    rows = shapes_dataset(3, seed=1)
    with pytest.raises(PlaitError, match=r"max_length=30 would cut into its 16 image tokens.*on_overlong='drop'"):
        prepare_dataset(rows, processor, "language_modeling", max_length=30, truncation_mode="keep_end", on_overlong="error")
    rows[0]["prompt"] = [user(ASK)]  # text-only row: fits
    rows[0]["images"] = []
    kept = prepare_dataset(rows, processor, "language_modeling", max_length=30, truncation_mode="keep_end")
    assert len(kept) == 1 and "dropped 2 of 3 examples" in caplog.text


def test_a_text_tokenizer_refuses_image_rows(tiny_vlm_path):
    with pytest.raises(PlaitError, match="without an image processor"):
        prepare_dataset(shapes_dataset(2), AutoTokenizer.from_pretrained(tiny_vlm_path), "language_modeling")


def test_embedded_images_in_parts_are_refused(processor):
    row = {"prompt": [user({"type": "image", "image": "x.png"}, ASK)], "completion": answer("red"), "images": [draw("circle", "red")]}
    with pytest.raises(PlaitError, match="'images' column"):
        prepare_dataset([row], processor, "language_modeling")


def test_preference_rows_share_the_prompt_images(processor, plugins):
    data = prepare_dataset(shapes_dataset(2, kind="preference"), processor, "preference")
    collate = image_collate(plugins, processor, "collator.preference")
    batch = collate([data[0], data[1]])
    assert batch["input_ids"].shape[0] == 4 and len(batch[KEY]) == 4
    pixels = model_inputs(batch)["pixel_values"]
    assert torch.equal(pixels[:2], pixels[2:])  # rows [chosen0, chosen1, rejected0, rejected1]


def test_logprobs_with_images_match_the_models_own_forward(processor, plugins, model):
    data = prepare_dataset(shapes_dataset(3, seed=2), processor, "language_modeling")
    collate = image_collate(plugins, processor)
    batch = collate([data[i] for i in range(3)])
    extra = model_inputs(batch)
    ours = assert_logprobs_match(model, batch, extra, chunk_size=7)
    # the images matter: other pixels give other log-probs of the answer
    other = {**extra, "pixel_values": torch.zeros_like(extra["pixel_values"])}
    with torch.no_grad():
        blind = token_logprobs(model, batch["input_ids"], batch["attention_mask"], **other).logps
    assert (blind - ours).abs().max() > 1e-4


def test_qwen2_vl_inputs_flattened_patches_grid_and_token_types(plugins):
    """Qwen2-VL's inputs are not Llava's: patches of all images flattened, image_grid_thw per image,
    and mm_token_type_ids aligned with the tokens; plait's log-probs still equal the model's own."""
    model, processor = tiny_qwen2_vl()
    data = prepare_dataset(shapes_dataset(3, seed=2), processor, "language_modeling")
    collate = image_collate(plugins, processor)
    batch = collate([data[i] for i in range(3)])
    extra = model_inputs(batch)
    assert extra["pixel_values"].shape[0] == 3 * 64 and extra["image_grid_thw"].tolist() == [[1, 8, 8]] * 3
    assert torch.equal(extra["mm_token_type_ids"].bool(), batch["input_ids"] == processor.image_token_id)
    assert int(extra["mm_token_type_ids"][0].sum()) == 16  # 8x8 patches merged 2x2
    assert_logprobs_match(model.eval(), batch, extra, chunk_size=5)
    one = model_inputs(batch, rows=torch.tensor([2]))  # a micro-batch of row 2 only
    assert one["pixel_values"].shape[0] == 64 and torch.equal(one["pixel_values"], extra["pixel_values"][128:])


def test_padding_free_batches_refuse_images(processor, plugins):
    data = prepare_dataset(shapes_dataset(2), processor, "language_modeling")
    with pytest.raises(PlaitError, match="padding_free=False and packing=False"):
        image_collate(plugins, processor, "collator.padding_free")([data[0], data[1]])


def test_standard_rows_hold_the_image_token_themselves(processor):
    image = [draw("circle", "red")]
    out = prepare_dataset([{"prompt": "<image>What colour?", "completion": " red", "images": image}], processor,
                          "language_modeling")[0]
    assert out["input_ids"][:N_IMAGE] == [processor.image_token_id] * N_IMAGE
    assert processor.tokenizer.decode([t for t, m in zip(out["input_ids"], out["completion_mask"]) if m]) == " red<|im_end|>"
    with pytest.raises(PlaitError, match=r"cannot pair the text with its 1 image.*'<image>' in a string"):
        prepare_dataset([{"prompt": "What colour?", "completion": " red", "images": image}], processor, "language_modeling")


def test_a_prompt_ending_in_an_assistant_turn_with_parts_is_continued(processor):
    row = {"prompt": [user(IMAGE, ASK), {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}],
           "completion": [{"role": "assistant", "content": " red"}], "images": [draw("circle", "red")]}
    out = prepare_dataset([row], processor, "language_modeling")[0]
    trained = [t for t, m in zip(out["input_ids"], out["completion_mask"]) if m]
    assert processor.tokenizer.decode(trained) == " red<|im_end|>\n"  # completion-only: the turn as rendered
