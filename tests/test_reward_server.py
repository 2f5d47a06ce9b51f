"""``plait reward-serve`` on real loopback sockets, and the ``remote`` reward that calls it: scores equal
the in-process reward model's, a wrong token and an oversize body are refused, concurrent requests
share forwards, a dead server is retried then left to reward_error_policy, and ``plait grpo`` trains
through ``{name: remote, url: ...}``."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from test_rewards import reward_model_folder  # noqa: F401 - the tiny reward-model folder (a fixture)

from plait.errors import PlaitError
from plait.online.scoring import compute_rewards, resolve_reward_funcs

PLAIT = Path(sys.executable).parent / "plait"
PROMPTS = ["What is 7 plus 5?", "Say hi", "The river", "Numbers such as"]
COMPLETIONS = [" The answer is 12.", " hi there", " flows", " 1, 2, 3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(reward_model_folder, tmp_path_factory):
    """``plait reward-serve`` with the tiny reward model and ``accuracy``; yields (url, token file)."""
    folder = tmp_path_factory.mktemp("server")
    port, token_file = free_port(), folder / "token"
    command = [str(PLAIT), "reward-serve", "--model", str(reward_model_folder), "--reward", "accuracy",
               "--port", str(port), "--token-file", str(token_file), "--max-body-bytes", "20000",
               "--batch-window", "0.3", "--max-batch-size", "64"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.stdout.read()
        try:
            call(url, "/health", None, token_file.read_text().strip())
            break
        except (OSError, urllib.error.URLError):
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
    yield url, token_file
    process.terminate()
    process.wait(timeout=30)


def call(url: str, route: str, body, token: str | None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url + route, data=data, headers=headers, method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def remote(plait_plugins, **params):
    (func,) = resolve_reward_funcs([{"name": "remote", **params}], plait_plugins)
    return func


@pytest.mark.slow  # the server subprocess loads plait and the model once per module (~20-50 s)
def test_remote_scores_equal_the_in_process_reward_model(plait_plugins, server, reward_model_folder):
    url, token_file = server
    (local,) = resolve_reward_funcs([str(reward_model_folder)], plait_plugins)
    ids = [[1]] * len(PROMPTS)
    expected = compute_rewards([local], prompts=PROMPTS, completions=COMPLETIONS, completion_ids=ids)
    served = compute_rewards([remote(plait_plugins, url=url, token_file=str(token_file), reward="tiny-rm")],
                             prompts=PROMPTS, completions=COMPLETIONS, completion_ids=ids)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(served, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the server subprocess loads plait and the model once per module (~20-50 s)
def test_a_served_reward_function_gets_the_dataset_columns(plait_plugins, server):
    url, token_file = server
    func = remote(plait_plugins, url=url, token_file=str(token_file), reward="accuracy")
    scores = compute_rewards([func], prompts=["1+1?", "2+2?"], completions=[r"\boxed{2}", r"\boxed{5}"],
                             completion_ids=[[1], [1]], columns={"solution": ["2", "4"]})
    assert scores[:, 0].tolist() == [1.0, 0.0]


@pytest.mark.slow  # the server subprocess loads plait and the model once per module (~20-50 s)
def test_a_wrong_or_missing_token_is_refused(plait_plugins, server):
    url, _ = server
    for token in ("wrong", None):
        with pytest.raises(urllib.error.HTTPError) as err:
            call(url, "/score", {"prompts": ["a"], "completions": ["b"], "reward": "accuracy"}, token)
        assert err.value.code == 401
    with pytest.raises(PlaitError, match="refused the request \\(401") as err:
        remote(plait_plugins, url=url, reward="accuracy", retries=0).fn(prompts=["a"], completions=["b"])
    assert "\n" not in str(err.value)


@pytest.mark.slow  # the server subprocess loads plait and the model once per module (~20-50 s)
def test_an_oversize_body_is_refused_before_it_is_read(plait_plugins, server):
    url, token_file = server
    with pytest.raises(urllib.error.HTTPError) as err:
        call(url, "/score", {"prompts": ["x" * 30000], "completions": ["b"]}, token_file.read_text().strip())
    assert err.value.code == 413 and "20000" in json.loads(err.value.read())["error"]


@pytest.mark.slow  # the server subprocess loads plait and the model once per module (~20-50 s)
def test_concurrent_requests_share_forwards(server):
    url, token_file = server
    token = token_file.read_text().strip()
    before = call(url, "/health", None, token)
    body = {"prompts": PROMPTS[:2], "completions": COMPLETIONS[:2], "reward": "tiny-rm"}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: call(url, "/score", body, token), range(8)))
    after = call(url, "/health", None, token)
    assert all(a == answers[0] for a in answers)
    requests = after["requests"] - before["requests"]
    forwards = after["forwards"]["tiny-rm"] - before["forwards"]["tiny-rm"]
    assert requests == 8 and 1 <= forwards < 8, (requests, forwards)


def test_a_dead_server_is_retried_then_left_to_the_error_policy(plait_plugins):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    func = remote(plait_plugins, url=url, token_file=None, retries=2, backoff=0.05)
    start = time.monotonic()
    scores = compute_rewards([func], prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 4,
                             on_error="none")
    assert torch.isnan(scores).all()
    assert 0.05 + 0.1 <= time.monotonic() - start < 5  # two backoffs, then the per-example calls end at once
    with pytest.raises(PlaitError, match="did not answer"):
        compute_rewards([remote(plait_plugins, url=url, retries=0, backoff=0.01)], prompts=PROMPTS[:1],
                        completions=COMPLETIONS[:1], completion_ids=[[1]], on_error="fail")


def test_bad_remote_parameters_are_one_line_errors(plait_plugins):
    with pytest.raises(PlaitError, match="url='localhost:8001' must be the server's address"):
        remote(plait_plugins, url="localhost:8001")


@pytest.mark.slow
def test_plait_grpo_trains_through_the_remote_reward(server, tmp_path):
    from plait.testing.tiny_model import tiny_model_path

    url, token_file = server
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": "grpo", "model": str(tiny_model_path()),
        "dataset": {"path": "json", "data_files": str(tmp_path / "prompts.jsonl")},
        "reward_funcs": [{"name": "remote", "url": url, "token_file": str(token_file), "reward": "tiny-rm"}],
        "training": dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                         learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True, seed=0,
                         max_steps=2, save_strategy="no"),
    }))
    output = tmp_path / "out"
    done = subprocess.run([str(PLAIT), "grpo", "--config", str(recipe), "--output_dir", str(output)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["rewards/remote/mean"] for row in logged if "rewards/remote/mean" in row]
    assert len(rewards) == 2 and all(math.isfinite(r) and r != 0 for r in rewards)


def test_concurrent_requests_are_coalesced_and_a_failing_one_fails_alone():
    """In-process (no model): 16 concurrent requests in a 0.1 s window are scored in fewer, bounded
    calls, each request gets its own rows back, and a request the reward raises on is a 500 for it alone."""
    import threading

    from plait.plugins.commands.reward_serve import RewardServer

    calls = []

    def length(prompts, completions, **kwargs):
        if "boom" in completions:
            raise ValueError("boom")
        calls.append(len(completions))
        time.sleep(0.05)
        return [float(len(c)) for c in completions]

    server = RewardServer(("127.0.0.1", 0), {"length": length}, max_batch_size=24, batch_window=0.1, token="t",
                          max_connections=32, header_timeout=10, max_body_bytes=2**20, body_timeout=10)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def post(i):
        completions = ["boom"] * 4 if i == 5 else ["x" * i] * 4
        try:
            return call(url, "/score", {"prompts": ["p"] * 4, "completions": completions}, "t")["scores"]
        except urllib.error.HTTPError as err:
            return err.code

    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(post, range(16)))
    finally:
        server.shutdown()
        server.server_close()
    assert answers[5] == 500
    assert all(answers[i] == [float(i)] * 4 for i in range(16) if i != 5)
    assert sum(calls) == 60 and len(calls) < 15 and max(calls) <= 24, calls
