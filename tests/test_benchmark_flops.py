"""benchmarks/flops.py against FLOPs counted by hand for a one-layer toy decoder.

Toy: hidden 8, intermediate 16, 2 heads of size 4, 1 key/value head, vocabulary 10. Its linears per
token: q 8·8 + k, v 2·8·4 + o 8·8 + gate, up 2·8·16 + down 16·8 = 576 multiply-adds, so 1,152 FLOPs;
attention 4·2·4 = 32 FLOPs per context token; the LM head 2·8·10 = 160 per position.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

spec = importlib.util.spec_from_file_location("flops", Path(__file__).parents[1] / "benchmarks" / "flops.py")
flops = importlib.util.module_from_spec(spec)
sys.modules.setdefault("flops", flops)  # dataclasses look their module up while the file runs
spec.loader.exec_module(flops)

TOY = flops.Model(hidden=8, intermediate=16, layers=1, heads=2, kv_heads=1, head_dim=4, vocab=10)


def total(method, rows, checkpointing=False, recompute_attention=False, **options):
    return flops.method_flops(method, TOY, rows, options, checkpointing, recompute_attention)


def test_per_token_parts():
    assert TOY.linear_flops() == 1152
    assert TOY.attention_flops(4) == 32 * 10  # causal: 1 + 2 + 3 + 4 context tokens
    assert TOY.attention_flops(2, past=3) == 32 * (4 + 5)
    assert TOY.head_flops(3) == 480
    assert TOY.lora_flops(2) == 512  # 2·2·(in + out) per linear: 64 + 96 + 64 + 192 + 96


def test_from_config_defaults_head_dim_and_kv_heads():
    config = SimpleNamespace(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                             vocab_size=10)
    assert flops.Model.from_config(config) == flops.Model(8, 16, 1, 2, 2, 4, 10)


def test_sft_forward_backward_and_recompute():
    # one 4-token row: 4 tokens of linears (4,608), 10 context tokens of attention (320), 3 trained positions (480)
    plain = total("sft", [(1, [3])])
    assert (plain["forward"], plain["backward"], plain["recompute"]) == (5408, 2 * (4608 + 480) + 2 * 320, 0)
    assert plain["total"] == plain["training"] == 16224 and plain["generation"] == 0
    assert total("sft", [(1, [3])], checkpointing=True)["total"] == 16224 + 4608  # the linears once more
    assert total("sft", [(1, [3])], checkpointing=True, recompute_attention=True)["total"] == 16224 + 4608 + 320


def test_dpo_holds_the_prompt_once_and_runs_the_reference():
    # prompt 2, chosen 1, rejected 2: 5 tokens, context 3 + (2 + 1) + (4 + 3) = 13, 3 head positions
    policy_forward = 5 * 1152 + 13 * 32 + 3 * 160
    out = total("dpo", [(2, [1, 2])])
    assert out["forward"] == 2 * policy_forward == 13312  # the policy's and the reference's
    assert out["total"] == 6656 + 13312 + 6656
    assert total("orpo", [(2, [1, 2])])["total"] == total("cpo", [(2, [1, 2])])["total"] == 6656 + 13312  # no reference


def test_dpo_lora_freezes_the_base_and_the_head():
    out = total("dpo_lora", [(2, [1, 2])], lora=2)
    lora = 5 * 512
    assert out["forward"] == (5760 + lora + 416 + 480) + 6656  # the reference has no adapters
    assert out["backward"] == (5760 + 480) + 2 * (lora + 416)  # base and head: the input's gradient only
    assert out["lm_head"] == 2 * 480 + 480


def test_kto_reward_model():
    # policy (2, [1]) trains; (2, [2]) its KL pass without grad; the reference scores (2, [1, 2])
    assert total("kto", [(2, [1, 2])])["total"] == 3808 + 7616 + 5248 + 6656
    # the score head: 2·8 per sequence, two sequences; no LM head
    out = total("reward_model", [(2, [1, 2])])
    assert (out["forward"], out["backward"], out["lm_head"]) == (6208, 12416, 3 * 32)


def test_generation_prefills_once_and_decodes_with_a_cache():
    # prompt 2, 3 new tokens, 2 samples: prefill 2·1152 + 3·32 + 160; decodes at context 3 and 4, each + 1152 + 160
    assert flops.generation_flops(TOY, flops.Generation(prompt=2, new=3, samples=2)) == 2560 + 2 * (1408 + 1440)
    grpo = total("grpo", [(2, [3, 3])])
    assert grpo["generation"] == 8256 and grpo["total"] == 8256 + grpo["training"]
    assert total("grpo", [(2, [3, 3])], beta=0.04)["forward"] > grpo["forward"]  # the reference joins
    assert total("online_dpo", [(2, [3, 3])], reference=True)["total"] == total("grpo", [(2, [3, 3])], beta=1)["total"]


def test_gkd_expects_lmbda_of_the_steps_on_policy():
    assert total("gkd", [(2, [1])])["total"] == 3808 + 7616 + 3808  # student and teacher
    mixed = total("gkd", [(2, [1])], lmbda=0.5, max_new_tokens=3)
    assert mixed["generation"] == pytest.approx(0.5 * 5408)
    assert mixed["total"] == pytest.approx(0.5 * 15232 + 0.5 * (6720 + 13440 + 6720 + 5408))


def test_gemm_shapes_merge_equal_linears():
    assert flops.gemm_shapes(TOY, "sft", [(1, [3])], {}) == [(4, 8, 8, 2), (4, 8, 4, 2), (4, 8, 16, 2), (4, 16, 8, 1),
                                                             (3, 8, 10, 1)]
    assert flops.gemm_shapes(TOY, "reward_model", [(2, [1, 2])], {})[-1] == (5, 16, 8, 1)  # no LM head


def side_by_side():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import trl_side_by_side

    return trl_side_by_side


def test_matmul_peak_is_the_flop_weighted_rate_of_the_gemms_it_timed():
    peak = side_by_side().matmul_peak([(16, 8, 8, 3), (4, 8, 32, 1)], bf16=False, budget_s=0.001, most=3)
    work = [3 * 2 * 16 * 8 * 8] * 3 + [2 * 4 * 8 * 32] * 3
    rates = [shape[3:6] for shape in peak["gemm_tflop_s"]]  # forward, input gradient, weight gradient
    row_major = [shape[6] for shape in peak["gemm_tflop_s"]]  # the weight gradient with dyᵀ copied row-major
    assert [shape[:3] for shape in peak["gemm_tflop_s"]] == [[16, 8, 8], [4, 8, 32]] and len(row_major) == 2
    assert peak["matmul_peak_tflop_s"] <= peak["best_gemm_tflop_s"]
    assert peak["best_gemm_tflop_s"] == pytest.approx(max(max(r) for r in rates), rel=0.01, abs=1e-3)
    # each weight gradient at the faster of its two layouts: a peak at least F.linear's
    assert peak["row_major_peak_tflop_s"] >= peak["matmul_peak_tflop_s"]
    assert peak["row_major_peak_tflop_s"] <= max(peak["best_gemm_tflop_s"], max(row_major)) * 1.01 + 1e-3


def test_summary_carries_each_librarys_flop_fraction():
    run = dict(method="orpo", length=128, setting="defaults", s_per_step=2.0, tokens_per_s=1.0, peak_rss_mib=100.0,
               load_1min=1.0, bf16=True, gradient_checkpointing=True)
    runs = [{**run, "library": "plait", "flop_fraction": 0.2, "achieved_tflop_s": 0.1, "matmul_peak_tflop_s": 0.5},
            {**run, "library": "trl", "s_per_step": 4.0, "flop_fraction": 0.1, "achieved_tflop_s": 0.05,
             "matmul_peak_tflop_s": 0.5}]
    row = side_by_side().summary(runs)["orpo@128/defaults"]
    assert (row["speedup"], row["plait_flop_fraction"], row["trl_flop_fraction"], row["trl_tflops_per_s"]) == (
        2.0, 0.2, 0.1, 0.05)


def test_one_librarys_runs_summarise_as_its_own_figures_and_a_failure_as_its_error(capsys):
    run = dict(library="plait", method="sft", length=512, setting="defaults", s_per_step=4.0, tokens_per_s=500.0,
               peak_rss_mib=3000.0, load_1min=0.5, bf16=True, gradient_checkpointing=True, flop_fraction=0.3,
               achieved_tflop_s=0.5, matmul_peak_tflop_s=1.7)
    bench = side_by_side()
    table = bench.summary([run, {**run, "s_per_step": 5.0, "flop_fraction": 0.2, "load_1min": 1.5}])
    assert table["sft@512/defaults"] == {
        "plait_s_per_step": 4.5, "plait_tokens_per_s": 500.0, "plait_peak_rss_mib": 3000.0, "plait_flop_fraction": 0.25,
        "plait_tflops_per_s": 0.5, "plait_peak_tflop_s": 1.7, "load_1min": [0.5, 1.5]}
    bench.print_table(table)
    printed = capsys.readouterr().out.splitlines()[-1]
    assert printed.split()[:2] == ["sft@512/defaults", "4.50"] and printed.endswith("(plait alone, 3000 MiB)")
    failed = bench.summary([{key: value for key, value in run.items() if key != "s_per_step"} | {"error": "boom"}])
    assert failed["sft@512/defaults"] == {"plait": ["boom"]}


def test_summary_carries_the_steady_state_and_the_peak_above_each_runs_floor(capsys):
    run = dict(method="sft", length=512, setting="defaults", tokens_per_s=1.0, load_1min=1.0, bf16=True,
               gradient_checkpointing=True)
    runs = [{**run, "library": "plait", "s_per_step": 4.0, "steady_s_per_step": 3.5, "steady_flop_fraction": 0.36,
             "peak_rss_mib": 3000.0, "floor_mib": 2600.0, "above_floor_mib": 400.0},
            {**run, "library": "trl", "s_per_step": 12.0, "steady_s_per_step": 10.5, "steady_flop_fraction": 0.12,
             "peak_rss_mib": 5000.0, "floor_mib": 3000.0, "above_floor_mib": 2000.0}]
    bench = side_by_side()
    row = bench.summary(runs)["sft@512/defaults"]
    assert (row["speedup"], row["steady_speedup"], row["memory_ratio"], row["above_floor_ratio"]) == (3.0, 3.0, 0.6, 0.2)
    assert (row["plait_steady_flop_fraction"], row["trl_floor_mib"]) == (0.36, 3000.0)
    bench.print_table({"sft@512/defaults": row})
    printed = capsys.readouterr().out.splitlines()[-1].split()
    assert printed[:4] == ["sft@512/defaults", "4.00", "12.00", "3.00x"]
    assert printed[-7:] == ["|", "3.50", "10.50", "3.00x", "36.0%", "|", "0.20"]
