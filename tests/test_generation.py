"""The generation-backend hook and the transformers backend on the real tiny model."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.errors import PlaitError
from plait.manager import make_plugins
from plait.online.generation import GenerationBackend, SamplingParams, encode_prompts
from plait.testing.tiny_model import tiny_model_path

CHAT = [{"role": "user", "content": "What is 7 plus 5?"}]


@pytest.fixture(scope="module")
def tiny():
    path = tiny_model_path()
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def factory():
    return make_plugins().generation_backends.get("generation.transformers").obj


# -- SamplingParams and prompts ---------------------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, "temperature=-0.5"),
    ("top_p", 0.0, r"top_p=0.0 must be in \(0.0, 1.0\]"),
    ("top_k", -1, "top_k=-1 must be an integer >= 0"),
    ("min_p", 1.5, "min_p=1.5"),
    ("num_generations", 0, "num_generations=0 must be an integer >= 1"),
    ("max_completion_length", 0, "max_completion_length=0"),
])
def test_sampling_params_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_encode_prompts_accepts_ids_text_and_conversations(tiny):
    _, tokenizer = tiny
    ids, text, chat = encode_prompts(tokenizer, [[5, 6, 7], "The river", CHAT])
    assert ids == [5, 6, 7]
    assert text == tokenizer("The river")["input_ids"]
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(chat).endswith("<|im_start|>assistant\n")
    with pytest.raises(PlaitError, match="prompt 1 is a float"):
        encode_prompts(tokenizer, ["ok", 3.5])
    with pytest.raises(PlaitError, match="prompt 0 is empty"):
        encode_prompts(tokenizer, [[]])


def test_backend_interface_defaults():
    class Echo(GenerationBackend):
        def generate(self, prompts, sampling):
            raise NotImplementedError

    backend = Echo()
    assert backend.shares_weights
    with backend as started:  # start/close through the context manager; sleep/wake/load_weights are no-ops
        started.sleep(), started.wake(), started.load_weights(None)
    with pytest.raises(TypeError):
        GenerationBackend()


# -- the transformers backend ------------------------------------------------------------------


def test_generates_grouped_completions_without_padding(tiny, factory):
    model, tokenizer = tiny
    backend = factory(model, tokenizer, None)
    torch.manual_seed(0)
    out = backend.generate(["The river", CHAT], SamplingParams(max_completion_length=6, num_generations=3))
    assert len(out) == 6 and out.logprobs is None
    prompt_ids = encode_prompts(tokenizer, ["The river", CHAT])
    assert out.prompt_ids == [prompt_ids[0]] * 3 + [prompt_ids[1]] * 3  # grouped by prompt
    for ids, text, finished in zip(out.completion_ids, out.texts, out.finished):
        assert 1 <= len(ids) <= 6
        assert tokenizer.pad_token_id not in ids
        assert finished == (ids[-1] == tokenizer.eos_token_id)
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stops_at_eos_and_cuts_what_follows(tiny, factory):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    # A strong bias on EOS makes rows stop at different steps: generate pads the finished rows.
    sampling = SamplingParams(max_completion_length=12, num_generations=16,
                              generation_kwargs={"sequence_bias": {(eos,): 5.0}})
    torch.manual_seed(1)
    out = factory(model, tokenizer, None).generate(["The river"], sampling)
    lengths = {len(ids) for ids in out.completion_ids}
    assert len(lengths) > 2, lengths  # rows of different lengths in one batch
    for ids, finished in zip(out.completion_ids, out.finished):
        assert ids.count(eos) == (1 if finished else 0)
        assert (ids[-1] == eos) == finished
        assert finished or len(ids) == 12
    assert any(out.finished) and not all(out.finished)


def test_greedy_is_deterministic_and_restores_training_mode(tiny, factory):
    model, tokenizer = tiny
    model.train()
    backend = factory(model, tokenizer, None)
    greedy = SamplingParams(max_completion_length=5, temperature=0.0, num_generations=2)
    first, second = backend.generate([CHAT], greedy), backend.generate([CHAT], greedy)
    assert first.completion_ids[0] == first.completion_ids[1] == second.completion_ids[0]
    assert model.training


def test_top_k_one_equals_greedy(tiny, factory):
    model, tokenizer = tiny
    backend = factory(model, tokenizer, None)
    greedy = backend.generate(["Python is"], SamplingParams(max_completion_length=5, temperature=0.0))
    top1 = backend.generate(["Python is"], SamplingParams(max_completion_length=5, temperature=1.0, top_k=1))
    assert greedy.completion_ids == top1.completion_ids


def test_max_batch_size_splits_the_call(tiny, factory):
    model, tokenizer = tiny

    class Args:
        generation_max_batch_size = 1

    backend = factory(model, tokenizer, Args())
    out = backend.generate(["The river", "Python is", CHAT], SamplingParams(max_completion_length=4, temperature=0.0))
    whole = factory(model, tokenizer, None).generate(["The river", "Python is", CHAT],
                                                     SamplingParams(max_completion_length=4, temperature=0.0))
    assert out.completion_ids == whole.completion_ids  # left padding does not change greedy outputs


def test_peft_and_ddp_wrapped_models_generate(tiny, factory, tmp_path):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny
    greedy = SamplingParams(max_completion_length=5, temperature=0.0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path()),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # move the adapters away from zero so they change the output
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1.0)
    plain = factory(model, tokenizer, None).generate(["The river"], greedy).completion_ids
    adapted = factory(peft_model, tokenizer, None).generate(["The river"], greedy).completion_ids
    assert adapted != plain  # the adapters are on while sampling
    with peft_model.disable_adapter():
        assert factory(peft_model, tokenizer, None).generate(["The river"], greedy).completion_ids == plain

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(AutoModelForCausalLM.from_pretrained(tiny_model_path()))
        assert factory(wrapped, tokenizer, None).generate(["The river"], greedy).completion_ids == plain
    finally:
        dist.destroy_process_group()
