"""The tiny model taught the calculator's call format by a short SFT, for tool-calling tests and demos.

``tool_model_path()`` trains the tiny model (:mod:`plait.testing.tiny_model`) for 60 steps on one
conversation (:data:`TOOL_CONVERSATION`): asked :data:`QUESTION`, call the calculator in the
``<tool_call>{json}</tool_call>`` format, read its result and answer. Sampled at a low temperature
it then calls the tool, so tests see real tool calls parsed, run and inserted. Built once per
cache, atomically, like the tiny model (about 10 s on one thread).

``tool_model_path(mixed=True)`` is taught both answers for 150 steps: the tool conversation and a
direct, wrong one (:data:`DIRECT_CONVERSATION`). Sampled at temperature 1 it calls the tool in
about a third of its episodes and answers right in about as many: a policy that can use the tool
and is not yet sure to, which a tool-use learning test needs.
"""

from __future__ import annotations

import pathlib

from .tiny_model import BUILDER_VERSION, cached_build, tiny_model_path

VERSION = "1"
QUESTION = "What is 3 + 4?"
ANSWER = "7"
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 + 4"}}}
TOOL_CONVERSATION = [{"role": "user", "content": QUESTION},
                     {"role": "assistant", "content": "", "tool_calls": [CALL]},
                     {"role": "tool", "name": "calculator", "content": ANSWER},
                     {"role": "assistant", "content": f"The answer is {ANSWER}"}]
DIRECT_CONVERSATION = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The answer is 9"}]


def build_tool_model(directory, *, steps: int = 60, seed: int = 0, conversations=(TOOL_CONVERSATION,)) -> pathlib.Path:
    """Fine-tune the tiny model on ``conversations`` (assistant tokens only) and save it to ``directory``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.data.chat import encode_with_assistant_mask
    from plait.manager import make_plugins

    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    calculator = make_plugins().environments.get("env.calculator")  # the built-in tool, as a run finds it
    schemas = [tool.schema for tool in calculator.obj(calculator.make_params()).tools]
    rows = [encode_with_assistant_mask(tokenizer, conv, tools=schemas) for conv in conversations]
    return teach(directory, tokenizer, model, rows, steps, seed)


def teach(directory, tokenizer, model, rows, steps: int, seed: int) -> pathlib.Path:
    """Train ``model`` for ``steps`` full-batch Adam steps on ``rows`` (token ids and assistant masks, as
    :func:`plait.data.chat.encode_with_assistant_mask` gives them; the loss on assistant tokens only)
    and save it with ``tokenizer`` to ``directory``."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, mask) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
        labels[i, :len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains many times faster on one thread than on a loaded machine's all
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
            for _ in range(steps):
                model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    directory = pathlib.Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tool_model_path(mixed: bool = False) -> pathlib.Path:
    """The cached tool-taught tiny model (``mixed``: also taught to answer directly), built on first use
    (atomic, process-safe)."""
    if mixed:
        return cached_build(f"tiny-tool-model-{BUILDER_VERSION}-{VERSION}-mixed", lambda folder: build_tool_model(
            folder, steps=150, conversations=(TOOL_CONVERSATION, DIRECT_CONVERSATION)))
    return cached_build(f"tiny-tool-model-{BUILDER_VERSION}-{VERSION}", build_tool_model)
