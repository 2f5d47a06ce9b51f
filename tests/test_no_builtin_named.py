"""The kernel names no built-in: core asks for the component registered as the default for a role
(``images``, ``sampling``), and TRL's surface names only the components its TRL names are.

With each such built-in disabled, plait still imports, ``plait --help`` still lists, a text-only
trainer still builds and a tiny SFT still trains; only the use that needs the missing plugin fails,
with one line naming the role (or the component) and how to get it back.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

import plait
from plait import GRPOConfig, PlaitError, SFTConfig, SFTTrainer, make_plugins
from plait.manager import default_plugins
from plait.online.generation import resolve_backend
from plait.testing.tiny_model import tiny_model_path
from plait.testing.tiny_vlm import shapes_dataset, tiny_qwen2_vl
from plait.trl import data_utils

PLAIT = Path(sys.executable).parent / "plait"
# every built-in that core or TRL's surface used to pick by name; SFT's own collator stays on
BUILT_INS = ["collator_images", "generation_transformers", "format_sharegpt", "format_implicit_preference",
             "collator_padding_free", "collator_preference", "collator_unpaired"]
DISABLED = ",".join(BUILT_INS)
SFT_OWN = {"collator_padding_free"}  # the SFT method chooses its collators (padded or padding-free) itself


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message and not isinstance(err.value, KeyError)
    return message


def test_plait_imports_and_lists_its_commands_without_them(tmp_path):
    env = {**os.environ, "PLAIT_DISABLE_PLUGINS": DISABLED, "PLAIT_CACHE_DIR": str(tmp_path)}
    imported = subprocess.run([sys.executable, "-c", "import plait; print(plait.SFTTrainer.__name__)"],
                              env=env, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0 and imported.stdout.strip() == "SFTTrainer", imported.stderr
    helped = subprocess.run([str(PLAIT), "--help"], env=env, capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "sft" in helped.stdout, helped.stderr


def test_a_tiny_sft_trains_without_them(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, save_strategy="no",
                         report_to=[], max_length=32, disable_tqdm=True)
        rows = [{"prompt": "The code is", "completion": " seven."}] * 4
        trainer = SFTTrainer(str(tiny_model_path()), args=args, train_dataset=Dataset.from_list(rows),
                             plugins=make_plugins(disable=set(BUILT_INS) - SFT_OWN))
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    assert [entry for entry in trainer.state.log_history if "train_loss" in entry]


def test_a_vlm_without_the_images_default_is_one_line_naming_the_role(tmp_path):
    model, processor = tiny_qwen2_vl()
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], save_strategy="no")
    with pytest.raises(PlaitError) as err:
        SFTTrainer(model, args=args, processing_class=processor, train_dataset=shapes_dataset(4),
                   plugins=make_plugins(disable=["collator_images"]))
    message = one_line(err)
    assert "no collator is registered as the default for 'images'" in message
    assert "default_for = 'images'" in message and "PLAIT_DISABLE_PLUGINS" in message


def test_the_sampling_default_is_asked_for_by_role():
    args = GRPOConfig(output_dir="/tmp/x", report_to=[])
    assert args.params.backend_name() is None  # no backend chosen: the default for 'sampling'
    assert resolve_backend(make_plugins(), args).name == "generation.transformers"
    with pytest.raises(PlaitError) as err:
        resolve_backend(make_plugins(disable=["generation_transformers"]), args)
    assert "no generation backend is registered as the default for 'sampling'" in one_line(err)


def test_two_defaults_for_one_role_are_refused_naming_both():
    def wrap(processing_class, *, inner):
        return inner

    wrap.default_for = "images"
    rival = plait.hookimpl(lambda register: register("mine.images", wrap))
    module = type(sys)("rival_images")
    module.register_collators = rival
    with pytest.raises(PlaitError, match=r"2 collators are registered as the default for 'images' "
                                         r"\(collator.images, mine.images\); disable all but one"):
        make_plugins(plugins=[module]).collators.default("images", "a VLM's image inputs")


@pytest.fixture
def trl_without_built_ins(monkeypatch):
    """TRL's functions use the process-wide plugins: rebuilt with the built-ins disabled, then restored."""
    monkeypatch.setenv("PLAIT_DISABLE_PLUGINS", DISABLED + ",collator_language_modeling")
    default_plugins.cache_clear()
    yield
    default_plugins.cache_clear()


SHAREGPT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}


@pytest.mark.parametrize("call, user, name", [
    (lambda: data_utils.maybe_convert_to_chatml(SHAREGPT), "maybe_convert_to_chatml", "format.sharegpt"),
    (lambda: data_utils.extract_prompt({"chosen": "a b c", "rejected": "a b d"}), "extract_prompt",
     "format.implicit_preference"),
    (lambda: data_utils.DataCollatorForPreference(pad_token_id=0), "DataCollatorForPreference", "collator.preference"),
    (lambda: data_utils.DataCollatorForUnpairedPreference(pad_token_id=0), "DataCollatorForUnpairedPreference",
     "collator.unpaired"),
    (lambda: data_utils.DataCollatorForLanguageModeling(pad_token_id=0), "DataCollatorForLanguageModeling",
     "collator.language_modeling"),
    (lambda: data_utils.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True),
     "DataCollatorForLanguageModeling", "collator.padding_free"),
])
def test_trl_names_whose_plugin_is_disabled_fail_in_one_line(trl_without_built_ins, call, user, name):
    with pytest.raises(PlaitError) as err:
        call()
    message = one_line(err)
    assert message.startswith(f"{user} is plait's {name!r}, which is not available: ")
    assert "which is disabled by PLAIT_DISABLE_PLUGINS=" in message


def test_trl_names_that_need_no_disabled_plugin_still_work(trl_without_built_ins):
    plain = {"messages": [{"role": "user", "content": "Hi"}]}
    assert data_utils.maybe_convert_to_chatml(plain) == plain  # nothing ShareGPT to convert: no format asked for
    assert data_utils.maybe_extract_prompt({"prompt": "a", "chosen": "b", "rejected": "c"})["prompt"] == "a"
