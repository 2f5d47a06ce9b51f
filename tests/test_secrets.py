"""Secrets never reach a file or a line a run writes (plait.engine.redact).

The rule (a name ending in ``_token``/``_key``/``_secret``, ``token``/``secret`` alone, or holding
``password``) is checked with hypothesis; each writer through its own interface; and end to end:
real tiny SFT and GRPO runs through the installed ``plait`` command, given a hub token, a vLLM
server token, a token inside ``model_init_kwargs`` on the command line and secrets in the recipe's
``env:``, save checkpoints, and then every byte of every file they wrote, and everything they
printed, is searched for the secret values.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from plait.engine import run_folder
from plait.engine.redact import SECRET_SUFFIXES, SPECIAL_TOKENS, is_secret_name, marker, masked, masked_argv
from plait.engine.run_folder import config_fields, json_value
from plait.errors import PlaitError
from plait.plugins.methods.grpo import GRPOConfig
from plait.plugins.methods.sft import SFTConfig
from plait.testing.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
PLAIT = Path(sys.executable).parent / "plait"

# -- the rule ----------------------------------------------------------------------------------------

# names that cannot be secrets: letters only (no suffix can match), none of the secret words
plain_names = st.from_regex(r"[a-z]{1,10}", fullmatch=True).filter(
    lambda name: name not in ("token", "secret") and "password" not in name)
secret_names = st.one_of(
    st.tuples(st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,10}", fullmatch=True), st.sampled_from(SECRET_SUFFIXES))
    .map("".join).filter(lambda name: name.lower() not in SPECIAL_TOKENS),
    st.from_regex(r"[a-z_]{0,6}password[a-z_]{0,6}", fullmatch=True),
    st.sampled_from(["token", "secret"]),
).flatmap(lambda name: st.sampled_from([name, name.upper(), name.capitalize()]))  # any case
leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=12))
plain_values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(plain_names, inner, max_size=3)),
                            max_leaves=12)


@given(secret_names, st.one_of(leaves.filter(lambda v: v is not None), st.lists(leaves), st.dictionaries(plain_names, leaves)))
def test_a_value_named_as_a_secret_is_replaced_whole_by_its_marker(name, value):
    assert is_secret_name(name)
    assert masked({name: value}) == {name: f"<{name.upper()}>"}


@given(plain_values)
def test_values_without_a_secret_name_are_left_as_they_are(value):
    assert masked(value) == value


@given(plain_values, st.lists(st.tuples(secret_names, plain_names), min_size=1, max_size=4))
def test_secrets_nested_at_any_depth_are_masked_and_nothing_else_changes(value, secrets):
    """Secrets hidden in dicts inside lists inside dicts: none of their values survive, and the
    structure around them is unchanged."""
    tree = {"outer": value}
    for index, (name, parent) in enumerate(secrets):
        tree = {parent: [tree, {name: f"SECRET-{index}-VALUE"}]}
    shown = masked(tree)
    assert "SECRET-" not in json.dumps(shown)
    assert "SECRET-" in json.dumps(tree)  # the input itself is not modified
    inner = shown
    for name, parent in reversed(secrets):
        inner, leaf = inner[parent]
        assert leaf == {name: marker(name)}
    assert inner == {"outer": value}


def test_special_tokens_and_unset_secrets_stay_in_clear():
    assert masked({"pad_token": "<|pad|>", "eos_token": "</s>", "hub_token": None}) == {
        "pad_token": "<|pad|>", "eos_token": "</s>", "hub_token": None}
    for name in ("hub_token", "vllm_server_token", "HF_TOKEN", "WANDB_API_KEY", "aws_secret", "DB_PASSWORD", "token"):
        assert is_secret_name(name), name
    for name in ("max_new_tokens", "average_tokens_across_devices", "keyword", "tokenizer", "monkey"):
        assert not is_secret_name(name), name


def test_an_echoed_command_line_shows_secret_flags_as_markers():
    argv = ["python", "-m", "plait.cli", "sft", "--hub_token", "hf_A", "--model_init_kwargs.token=hf_B",
            "--learning_rate", "1e-3", "--vllm_server_token", "x", "y", "--seed", "1"]
    assert masked_argv(argv) == ["python", "-m", "plait.cli", "sft", "--hub_token", "<HUB_TOKEN>",
                                 "--model_init_kwargs.token=<TOKEN>", "--learning_rate", "1e-3",
                                 "--vllm_server_token", "<VLLM_SERVER_TOKEN>", "<VLLM_SERVER_TOKEN>", "--seed", "1"]


# -- the config: what transformers logs and pickles ----------------------------------------------------

def grpo_config(tmp_path, **overrides) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to=[],
                      hub_token="hf_HUBSECRET", vllm_server_token="VLLMSECRET",
                      model_init_kwargs={"token": "hf_INITSECRET", "dtype": "float32"}, **overrides)


def test_the_config_logs_and_pickles_no_secret_but_keeps_using_it(tmp_path):
    args = grpo_config(tmp_path)
    shown = [args.to_json_string(), str(args.to_sanitized_dict()), repr(args), str(args)]
    torch.save(args, tmp_path / "training_args.bin")
    for text in [*shown, pickle.dumps(args).decode("latin-1"), (tmp_path / "training_args.bin").read_bytes().decode("latin-1")]:
        assert "SECRET" not in text
    assert "<VLLM_SERVER_TOKEN>" in repr(args) and "'dtype': 'float32'" in repr(args)
    # the live config still holds the secrets its run needs
    assert (args.hub_token, args.vllm_server_token) == ("hf_HUBSECRET", "VLLMSECRET")
    restored = torch.load(tmp_path / "training_args.bin", weights_only=False)
    assert type(restored) is GRPOConfig and restored.params.num_generations == 4
    assert (restored.hub_token, restored.vllm_server_token) == ("<HUB_TOKEN>", "<VLLM_SERVER_TOKEN>")
    assert restored.model_init_kwargs == {"token": "<TOKEN>", "dtype": "float32"}


# -- the rerun check: compares masked to masked ----------------------------------------------------------

def recorded_run(tmp_path, args, clear: bool) -> None:
    """An output_dir holding the final model's plait_run.json for ``args`` (secrets in clear, as an
    older plait wrote them, or masked)."""
    config = {k: json_value(getattr(args, k)) for k in config_fields(type(args))}
    record = {"method": "sft", "config": config if clear else masked(config)}
    (tmp_path / run_folder.RUN_METADATA).write_text(json.dumps(record))


@pytest.mark.parametrize("clear", [True, False], ids=["recorded-in-clear", "recorded-masked"])
def test_the_same_run_reruns_into_its_folder_whatever_its_secrets(tmp_path, clear):
    def sft(**fields) -> SFTConfig:
        return SFTConfig(output_dir=str(tmp_path), report_to=[], **{"model_init_kwargs": {"token": "hf_OLD"}, **fields})

    recorded_run(tmp_path, sft(hub_token="hf_OLD"), clear)
    for rotated in (sft(hub_token="hf_NEW"), sft(), sft(hub_token="hf_NEW", model_init_kwargs={"token": "hf_NEW"})):
        run_folder.output_dir(rotated, "sft")  # the same run: a credential is no setting
    with pytest.raises(PlaitError, match="another sft run") as refused:
        run_folder.output_dir(sft(hub_token="hf_OLD", model_init_kwargs={"token": "hf_OLD", "dtype": "float32"}), "sft")
    assert "<TOKEN>" in str(refused.value) and "hf_OLD" not in str(refused.value)


# -- end to end: every byte a run writes ------------------------------------------------------------------

SECRETS = {"hub_token": "hf_HubSecret1234", "vllm_server_token": "VllmSecret5678", "WANDB_API_KEY": "EnvKey9012",
           "PLAIT_TEST_PASSWORD": "EnvPassword3456", "model_init_kwargs.token": "hf_InitSecret7890"}


def write_recipe(path: Path, method: str, dataset: str, output_dir: Path, training: dict, **top) -> Path:
    path.write_text(yaml.safe_dump({
        "method": method, "model": str(tiny_model_path()), "env": {k: SECRETS[k] for k in ("WANDB_API_KEY", "PLAIT_TEST_PASSWORD")},
        "dataset": {"path": "json", "data_files": str(ROOT / "examples" / "data" / dataset)}, **top,
        "training": {"output_dir": str(output_dir), "max_steps": 2, "save_steps": 1, "logging_steps": 1,
                     "report_to": "none", "hub_token": SECRETS["hub_token"], **training},
    }))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, str]:
    """Two finished runs with checkpoints (SFT started through the launcher, which echoes its command;
    GRPO with a vLLM server token), resumed once; their folder and everything they printed."""
    recipes, root = tmp_path_factory.mktemp("secret-recipes"), tmp_path_factory.mktemp("secret-runs")
    sft = write_recipe(recipes / "sft.yaml", "sft", "demo_sft.jsonl", root / "sft",
                       {"per_device_train_batch_size": 4, "max_length": 64})
    grpo = write_recipe(recipes / "grpo.yaml", "grpo", "demo_preferences.jsonl", root / "grpo",
                        {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8,
                         "beta": 0.0, "vllm_server_token": SECRETS["vllm_server_token"]},
                        reward_funcs=[{"name": "soft_overlong", "max_len": 16, "cache": 8}])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    commands = [
        ["sft", "--config", str(sft), "--model_init_kwargs.token", SECRETS["model_init_kwargs.token"],
         "--accelerate_config", "cpu_ddp", "--num_processes", "1"],
        ["grpo", "--config", str(grpo)],
        # resumed from a checkpoint whose training_args.bin holds markers: the tokens come from this config
        ["sft", "--config", str(sft), "--model_init_kwargs.token", SECRETS["model_init_kwargs.token"],
         "--max_steps", "3", "--resume_from_checkpoint", "latest"],
    ]
    printed = ""
    for command in commands:
        result = subprocess.run([str(PLAIT), *command], capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        printed += result.stdout + result.stderr
    state = json.loads((root / "sft" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]
    assert "plait: " in printed and "torch.distributed.run" in printed  # the launcher echoed its command
    return root, printed


def files_holding_secrets(root: Path) -> dict[str, list[str]]:
    """{file relative to root: the secrets its bytes hold}, over every file under root."""
    found = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        held = [name for name, value in SECRETS.items() if value.encode() in data]
        if held:
            found[str(path.relative_to(root))] = held
    return found


def test_no_file_a_run_writes_holds_a_secret_outside_its_run_metadata(runs):
    root, _ = runs
    assert len([p for p in root.rglob("checkpoint-*/training_args.bin")]) == 5  # sft 1-3, grpo 1-2
    assert files_holding_secrets(root) == {}  # plait_run.json, training_args.bin, README.md, every checkpoint
    card = (root / "grpo" / "README.md").read_text()
    assert "- vllm_server_token: <VLLM_SERVER_TOKEN>" in card  # set, and shown as set, on the published card


def test_nothing_a_run_prints_holds_a_secret(runs):
    _, printed = runs
    assert [name for name, value in SECRETS.items() if value in printed] == []
    assert "--model_init_kwargs.token '<TOKEN>'" in printed
