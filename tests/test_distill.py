"""On-policy distillation: the JSD loss against full softmaxes, the chunked two-model path against
the direct one, bounded logits memory, bad inputs, learning on the tiny model, and the CLI."""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from plait import PlaitError, hookimpl, make_plugins
from plait.cli import main
from plait.engine.batches import TokenDistributions
from plait.engine.logprobs import compare_distributions, token_logprobs
from plait.losses.distill_jsd import JSDParams, distill_jsd
from plait.online.generation import GenerationBackend, Generations
from plait.plugins.methods.distill import DistillConfig, DistillTrainer
from plait.testing import check_loss
from plait.testing.tiny_model import build_tiny_model, noisy_tiny_model, tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
FEW = settings(max_examples=15, deadline=None)
VOCAB = 40


# ---------------------------------------------------------------------------------------------
# The loss against full softmaxes
# ---------------------------------------------------------------------------------------------


def kl_direct(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) from probabilities, in float64."""
    return (p * (p.log() - q.log())).sum(-1)


def jsd(student_logits, teacher_logits, beta):
    batch = TokenDistributions(student_logits.log_softmax(-1), teacher_logits.log_softmax(-1))
    return distill_jsd(batch, JSDParams(beta))


def random_logits(seed: int, n: int = 6, v: int = 11, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale, torch.randn(n, v, generator=g) * scale


@pytest.mark.parametrize("seed", range(3))
def test_beta_zero_is_forward_kl_and_beta_one_is_reverse_kl(seed):
    s, t = random_logits(seed)
    ps, pt = s.double().softmax(-1), t.double().softmax(-1)
    torch.testing.assert_close(jsd(s, t, 0.0).double(), kl_direct(pt, ps), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(jsd(s, t, 1.0).double(), kl_direct(ps, pt), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_between_it_is_the_mixture_formula(beta):
    s, t = random_logits(int(beta * 10))
    ps, pt = s.double().softmax(-1), t.double().softmax(-1)
    m = (1 - beta) * ps + beta * pt
    expected = beta * kl_direct(pt, m) + (1 - beta) * kl_direct(ps, m)
    torch.testing.assert_close(jsd(s, t, beta).double(), expected, rtol=1e-5, atol=1e-6)


def test_it_is_zero_for_equal_distributions_and_finite_for_one_hot_ones():
    s, _ = random_logits(7)
    for beta in (0.0, 0.3, 1.0):
        assert jsd(s, s, beta).abs().max() < 1e-6
    one_hot = torch.full((2, 5), -1e4)
    one_hot[:, 0] = 0.0
    other = torch.zeros(2, 5)
    for beta in (0.0, 0.5, 1.0):
        assert torch.isfinite(jsd(one_hot, other, beta)).all()
    masked = torch.tensor([[0.0, float("-inf"), 1.0]])  # a model that masks a token with −inf
    assert torch.isfinite(jsd(masked, torch.zeros(1, 3), 0.5)).all()


def jsd_by_autograd(s, t, beta):
    """The divergence in float64 from its definition, for autograd to differentiate."""
    ps, pt = s.softmax(-1), t.softmax(-1)
    if beta == 0.0:
        return kl_direct(pt, ps)
    if beta == 1.0:
        return kl_direct(ps, pt)
    m = (1 - beta) * ps + beta * pt
    return beta * kl_direct(pt, m) + (1 - beta) * kl_direct(ps, m)


@FEW
@given(seed=st.integers(0, 2**16), beta=st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0]),
       scale=st.sampled_from([0.1, 3.0, 12.0]))
def test_its_written_out_gradient_is_autograds_of_the_definition(seed, beta, scale):
    # the loss differentiates itself (one pass per input, not autograd's chain over [N, V]); it must
    # agree with autograd through the textbook formula
    s, t = random_logits(seed, scale=scale)
    s = s.double().requires_grad_()
    weights = torch.rand(s.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    got, = torch.autograd.grad((jsd(s, t, beta).double() * weights).sum(), s)
    want, = torch.autograd.grad((jsd_by_autograd(s, t.double(), beta) * weights).sum(), s)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_masked_token_gets_no_gradient_and_no_nan():
    s = torch.tensor([[0.5, float("-inf"), 1.0]], requires_grad=True)
    for beta in (0.0, 0.5, 1.0):
        grad, = torch.autograd.grad(jsd(s, torch.zeros(1, 3), beta).sum(), s)
        assert torch.isfinite(grad).all() and grad[0, 1] == 0


def test_beta_outside_the_unit_interval_is_refused():
    component = make_plugins().losses.get("distill.jsd")
    with pytest.raises(PlaitError, match=r"beta=1.5 must be in \[0.0, 1.0\]"):
        component.make_params(beta=1.5)
    with pytest.raises(PlaitError, match="beta=-0.1"):
        DistillConfig(output_dir="x", beta=-0.1, teacher_model_name_or_path="t")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_it_passes_the_kits_contract(beta):
    checked = check_loss("distill.jsd", make_plugins(), params={"beta": beta})
    assert {"gradient reaches the policy", "no gradient into the reference", "batch-mean independence"} <= set(checked)


# ---------------------------------------------------------------------------------------------
# Two models, chunk by chunk
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def llama(hidden: int, seed: int, vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=hidden // 2, vocab_size=vocab)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # peaked distributions, so an error in either model's projection would show
        model.lm_head.weight.mul_(6.0)
    return model


def direct(student, teacher, ids, select, temperature, beta):
    """The reference computation: full logits of both models, full softmaxes, the formula in probabilities."""
    ps = (student(ids).logits.double() / temperature).softmax(-1)[:, :-1]
    with torch.no_grad():
        pt = (teacher(ids).logits.double() / temperature).softmax(-1)[:, :-1]
    if beta == 0.0:
        values = kl_direct(pt, ps)
    elif beta == 1.0:
        values = kl_direct(ps, pt)
    else:
        m = (1 - beta) * ps + beta * pt
        values = beta * kl_direct(pt, m) + (1 - beta) * kl_direct(ps, m)
    values = torch.cat([values.new_zeros(ids.shape[0], 1), values], dim=1)  # aligned to the predicted token
    return values * select


def grads(model, loss) -> dict:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@FEW
@given(
    b=st.integers(1, 3), t=st.integers(2, 9), chunk=st.integers(1, 7), seed=st.integers(0, 2**16),
    temperature=st.sampled_from([0.5, 1.0, 1.7]), beta=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_chunked_equals_direct_in_values_and_gradients(b, t, chunk, seed, temperature, beta):
    student, teacher = llama(32, 0), llama(16, 1)  # different hidden sizes, one vocabulary
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    select = torch.rand(b, t, generator=g) > 0.3
    p = JSDParams(beta)
    chunked, = compare_distributions(student, teacher, ids, fn=lambda s, q: distill_jsd(TokenDistributions(s, q), p),
                                     select=select, temperature=temperature, chunk_size=chunk)
    expected = direct(student, teacher, ids, select, temperature, beta)
    torch.testing.assert_close(chunked.double(), expected, rtol=1e-4, atol=1e-5)
    weights = torch.rand(b, t, generator=g)  # a loss touching every position differently
    got, want = grads(student, (chunked * weights).sum()), grads(student, (expected * weights).sum().float())
    assert got.keys() == want.keys() and not any(p.grad is not None for p in teacher.parameters())
    for name in want:
        scale = max(1.0, want[name].abs().max().item())
        assert (got[name] - want[name]).abs().max().item() <= 1e-4 * scale, name


def test_the_plain_path_gives_the_same_values_and_unselected_positions_are_zero():
    student, teacher = llama(32, 0), llama(16, 1)
    ids = torch.randint(0, VOCAB, (2, 7))
    select = torch.zeros(2, 7, dtype=torch.bool)
    select[:, 3:] = True

    def fn(s, q):
        return distill_jsd(TokenDistributions(s, q), JSDParams(0.5)), -(s.exp() * s).sum(-1)

    chunked = compare_distributions(student, teacher, ids, fn=fn, select=select, chunk_size=3)
    plain = compare_distributions(student, teacher, ids, fn=fn, select=select, chunked=False)
    for a, b in zip(chunked, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert bool((a[~select] == 0).all())
    entropy = token_logprobs(student, ids, with_entropy=True).entropy  # the same alignment as token_logprobs
    torch.testing.assert_close(chunked[1][select], entropy[select], rtol=1e-5, atol=1e-6)


def test_different_vocabularies_are_refused():
    with pytest.raises(PlaitError, match="same vocabulary"):
        compare_distributions(llama(32, 0), llama(16, 1, vocab=VOCAB + 1), torch.zeros(1, 4, dtype=torch.long),
                              fn=lambda s, q: (s - q).sum(-1))


class LargestVocabularyTensor(TorchDispatchMode):
    """Records the largest tensor over positions × vocabulary that any op produces.

    Tensors shaped like an output layer's weight ([hidden, V]: its transpose and gradient) are
    parameter-sized, the same for any batch, and not counted.
    """

    def __init__(self, vocab: int, hidden_sizes: tuple[int, ...]):
        super().__init__()
        self.vocab, self.hidden_sizes, self.largest = vocab, hidden_sizes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[-1] == self.vocab:
                if not (leaf.dim() == 2 and leaf.shape[0] in self.hidden_sizes):
                    self.largest = max(self.largest, leaf.numel())
        return out


def largest_logits(chunk_size: int | None, *, chunked: bool = True, vocab: int = 2048, t: int = 48) -> int:
    student, teacher = llama(24, 0, vocab), llama(12, 1, vocab)
    ids = torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(0))
    fn = functools.partial(lambda s, q, p: distill_jsd(TokenDistributions(s, q), p), p=JSDParams(0.5))
    with LargestVocabularyTensor(vocab, (24, 12)) as probe:
        out, = compare_distributions(student, teacher, ids, fn=fn, chunk_size=chunk_size, chunked=chunked)
        out.sum().backward()
    return probe.largest


def test_a_steps_logits_memory_grows_with_chunk_size_not_with_sequence_times_vocabulary():
    vocab, batch, t = 2048, 2, 48
    sizes = {chunk: largest_logits(chunk, vocab=vocab, t=t) for chunk in (4, 8, 32)}
    # Every vocabulary-wide tensor of a step (both models' logits, log-softmaxes, the mixture, and
    # their recomputation in backward) holds at most one chunk of positions.
    assert sizes == {chunk: chunk * vocab for chunk in sizes}
    assert largest_logits(8, vocab=vocab, t=2 * t) == 8 * vocab  # twice the sequence: the same peak
    assert largest_logits(None, chunked=False, vocab=vocab, t=t) >= batch * t * vocab  # what it avoids


# ---------------------------------------------------------------------------------------------
# The method on the tiny model
# ---------------------------------------------------------------------------------------------

WORDS = ["river", "stone", "cloud", "music", "garden", "window", "paper", "market", "forest", "bridge", "doctor",
         "summer"]
ANSWER = "The answer is 12."


def prompt(word: str) -> list[dict]:
    return [{"role": "user", "content": f"Tell me about the {word}."}]


def prompts(words) -> Dataset:
    return Dataset.from_list([{"prompt": prompt(w)} for w in words])


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, max_completion_length=6,
                  learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0)
    return DistillConfig(**{**values, **overrides})


def answer_pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    rows = []
    for word in WORDS:
        text = tokenizer.apply_chat_template(prompt(word), add_generation_prompt=True, tokenize=False)
        rows.append((tokenizer(text, add_special_tokens=False).input_ids,
                     tokenizer(ANSWER, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]))
    return rows


@functools.lru_cache(maxsize=None)
def teacher_state() -> dict:
    """The tiny model fine-tuned to answer every prompt with ANSWER (a few full-batch steps)."""
    path = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = answer_pairs(tokenizer)
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels, attention = torch.full_like(ids, -100), torch.zeros_like(ids)
    for i, (a, b) in enumerate(rows):
        ids[i, :len(a) + len(b)] = torch.tensor(a + b)
        labels[i, len(a):len(a) + len(b)] = torch.tensor(b)
        attention[i, :len(a) + len(b)] = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(20):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def teacher_model():
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    model.load_state_dict(teacher_state())
    return model


def answer_logprob(model, tokenizer) -> float:
    """Mean per-token log-prob of ANSWER after each prompt: how much the model says what the teacher says."""
    total = 0.0
    for a, b in answer_pairs(tokenizer):
        with torch.no_grad():
            total += token_logprobs(model, torch.tensor([a + b])).logps[0, len(a):].mean().item()
    return total / len(WORDS)


@pytest.mark.slow
def test_the_student_moves_towards_a_teacher_that_prefers_a_fixed_answer(tmp_path):
    start = time.time()
    teacher = teacher_model()
    args = config(tmp_path, per_device_train_batch_size=8, per_device_eval_batch_size=4, max_steps=20,
                  max_completion_length=8, learning_rate=5e-3, logging_steps=5)
    trainer = DistillTrainer(str(tiny_model_path()), teacher_model=teacher, args=args,
                             train_dataset=prompts(WORDS[:8]), eval_dataset=prompts(WORDS[8:]))
    tokenizer = trainer.processing_class
    assert answer_logprob(teacher, tokenizer) > -0.5  # the teacher really prefers the answer
    before_logprob = answer_logprob(trainer.model, tokenizer)
    before = trainer.evaluate()["eval_divergence"]
    trainer.train()
    after = trainer.evaluate()["eval_divergence"]
    after_logprob = answer_logprob(trainer.model, tokenizer)
    assert after < 0.7 * before, (before, after)  # reverse KL to the teacher on held-out prompts, on-policy
    assert after_logprob > before_logprob + 2.0, (before_logprob, after_logprob)  # its answers move to the teacher's
    logged = [h for h in trainer.state.log_history if "divergence" in h]
    assert logged[-1]["divergence"] < logged[0]["divergence"] and logged[-1]["entropy"] < logged[0]["entropy"]
    assert {"completions/mean_length", "completions/clipped_ratio", "entropy"} <= set(logged[0])
    print(f"divergence {before:.3f} -> {after:.3f}, answer log-prob {before_logprob:.2f} -> {after_logprob:.2f}, "
          f"{time.time() - start:.1f} s")


class FixedLengths(GenerationBackend):
    """A generation backend whose completions depend only on the prompt, with 1 to 5 tokens + EOS:
    both runs below see the same completions, and rows hold different token counts."""

    def __init__(self, model, processing_class, args=None):
        self.eos = processing_class.eos_token_id

    def generate(self, prompts, sampling):
        completions = [[(sum(p) + k) % 900 + 50 for k in range(1 + sum(p) % 5)] + [self.eos] for p in prompts]
        return Generations(prompt_ids=list(prompts), completion_ids=completions, texts=["x"] * len(prompts),
                           finished=[True] * len(prompts))


class FixedLengthsPlugin:
    @hookimpl
    def register_generation_backends(self, register):
        register("generation.fixed_lengths", FixedLengths)


def test_gradient_accumulation_normalises_by_the_tokens_of_the_whole_step(tmp_path):
    """One step of 8 prompts and one step of 2 × 4 prompts give the same update, although the two
    micro-batches hold different numbers of completion tokens."""
    updates = []
    for batch, accumulation in ((8, 1), (4, 2)):
        args = config(tmp_path / f"{batch}", per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                      max_steps=1, shuffle_dataset=False, max_grad_norm=0.0, optim="sgd", learning_rate=1.0,
                      generation_backend="fixed_lengths")
        trainer = DistillTrainer(str(tiny_model_path()), teacher_model=noisy_tiny_model(), args=args,
                                 train_dataset=prompts(WORDS[:8]), plugins=make_plugins(plugins=[FixedLengthsPlugin()]))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        updates.append({n: p.detach() - before[n] for n, p in trainer.model.named_parameters()})
    assert any(u.abs().max() > 0 for u in updates[0].values())
    for name in updates[0]:
        torch.testing.assert_close(updates[0][name], updates[1][name], rtol=1e-4, atol=1e-7)


def test_with_lora_only_the_adapters_learn_and_completions_are_logged(tmp_path, capsys):
    from peft import LoraConfig

    args = config(tmp_path, max_steps=1, log_completions=True, num_completions_to_print=2, learning_rate=1e-2)
    trainer = DistillTrainer(str(tiny_model_path()), teacher_model=noisy_tiny_model(), args=args,
                             train_dataset=prompts(WORDS[:4]), peft_config=LoraConfig(r=4, target_modules="all-linear"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    table = capsys.readouterr().out
    assert "prompt" in table and "completion" in table and "Tell me about the" in table


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory):
    """A tiny model whose tokenizer was trained on other text: same vocabulary size, different tokens."""
    return str(build_tiny_model(tmp_path_factory.mktemp("other"), seed=1))


@pytest.mark.parametrize("case", ["vocabulary size", "tokenizer"])
def test_a_teacher_with_another_vocabulary_is_refused_up_front(tmp_path, case, other_tokenizer_model):
    if case == "vocabulary size":
        teacher = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, vocab_size=500))
        match = "teacher_model has vocab_size 500 but the student has"
    else:
        teacher = other_tokenizer_model
        match = "different tokenizer than the student"
    with pytest.raises(PlaitError, match=match):
        DistillTrainer(str(tiny_model_path()), teacher_model=teacher, args=config(tmp_path),
                       train_dataset=prompts(WORDS[:4]))


@pytest.mark.parametrize("kwargs, overrides, match", [
    ({}, {}, "needs a teacher"),
    ({"teacher_model": "x"}, {"teacher_model_name_or_path": "y"}, "given both"),
    ({"teacher_model": "/nonexistent/teacher"}, {}, "teacher_model='/nonexistent/teacher': no such folder"),
    ({"teacher_model": "x"}, {"loss": [{"name": "jsd", "beta": 2.0}]}, "beta=2.0"),
    ({"teacher_model": "x"}, {"loss": ["sigmoid"]}, "unknown loss 'sigmoid'"),
    ({"teacher_model": "x"}, {"generation_backend": "nope"}, "unknown generation backend 'nope'"),
])
def test_bad_configurations_fail_before_loading(tmp_path, kwargs, overrides, match):
    with pytest.raises(PlaitError, match=match):
        DistillTrainer(str(tiny_model_path()), args=config(tmp_path, **overrides), train_dataset=prompts(WORDS[:4]),
                       **kwargs)


# ---------------------------------------------------------------------------------------------
# Registry and CLI
# ---------------------------------------------------------------------------------------------


def test_distill_is_registered_with_its_loss_and_gets_a_command(capsys):
    plugins = make_plugins()
    assert plugins.methods.get("method.distill").obj.loss_family == "distill"
    assert plugins.losses.get("distill.jsd").options.consumes is TokenDistributions
    with pytest.raises(SystemExit):
        main(["--help"], plugins=plugins)
    assert "distill" in capsys.readouterr().out


def recipe(tmp_path, name: str, model: str, rows: list[dict], **training) -> Path:
    """The shipped recipe with this machine's model and data, and the given training overrides."""
    data = yaml.safe_load((ROOT / "examples" / "recipes" / name).read_text())
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data["model"] = model
    data["dataset"]["data_files"] = str(data_file)
    data["training"] = {**data["training"], "output_dir": str(tmp_path / "out"), **training}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_plait_distill_runs_the_recipe(tmp_path):
    teacher = tmp_path / "teacher"
    teacher_model().save_pretrained(teacher)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(teacher)
    path = recipe(tmp_path, "distill_tiny.yaml", str(tiny_model_path()), [{"prompt": prompt(w)} for w in WORDS],
                  teacher_model_name_or_path=str(teacher), max_steps=2, max_completion_length=4)
    assert main(["distill", "--config", str(path), "--learning_rate", "1e-4"], plugins=make_plugins()) == 0
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists()
    assert json.loads((out / "plait_run.json").read_text())["method"] == "distill"
    assert math.isclose(json.loads((out / "plait_run.json").read_text())["config"]["learning_rate"], 1e-4)
