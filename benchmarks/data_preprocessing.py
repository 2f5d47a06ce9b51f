"""Data-layer benchmark: preprocessing throughput and packing efficiency.

Generates a dataset with a realistic, long-tailed (log-normal) length spread, tokenises it with
``plait.data.prepare.prepare_dataset`` (standard text and conversational prompt-completion), and packs
it with bfd, bfd_split and wrapped, against no packing (batches padded to their longest row).

    python benchmarks/data_preprocessing.py [--rows 4000] [--max-length 512] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def synthetic_rows(n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Standard texts and conversations whose lengths follow a log-normal spread (median ~60 words)."""
    from plait.testing.tiny_model import _WORDS

    rng = random.Random(seed)

    def words(median: float) -> str:
        k = max(1, int(rng.lognormvariate(math.log(median), 0.9)))
        return " ".join(rng.choices(_WORDS, k=k)).capitalize() + "."

    texts = [{"text": words(60)} for _ in range(n)]
    chats = [
        {"prompt": [{"role": "user", "content": words(20)}], "completion": [{"role": "assistant", "content": words(50)}]}
        for _ in range(n)
    ]
    return texts, chats


def unpacked_efficiency(lengths: list[int], batch_size: int, max_length: int, seed: int) -> tuple[float, int]:
    """Real tokens / padded slots when shuffled batches are padded to their longest row."""
    rng = random.Random(seed)
    order = [min(n, max_length) for n in lengths]
    rng.shuffle(order)
    slots = rows = 0
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        slots += max(batch) * len(batch)
        rows += len(batch)
    return sum(order) / slots, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import datasets
    from transformers import AutoTokenizer

    from plait import default_plugins
    from plait.data.prepare import pack_dataset, packing_efficiency, prepare_dataset
    from plait.testing.tiny_model import tiny_model_path

    datasets.disable_progress_bars()
    logging.getLogger("plait").setLevel(logging.ERROR)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    plugins = default_plugins()
    texts, chats = synthetic_rows(args.rows, args.seed)

    print(f"plait data benchmark: {args.rows} rows per dataset, max_length {args.max_length}, tiny byte-level BPE tokenizer")
    print("\npreprocessing (prepare_dataset, single process)")
    print(f"  {'dataset':<38}{'rows/s':>10}{'tokens/s':>12}{'tokens':>10}")
    prepared = {}
    for name, rows, task in (
        ("standard text -> language_modeling", texts, "language_modeling"),
        ("conversational prompt-completion", chats, "language_modeling"),
    ):
        dataset = datasets.Dataset.from_list(rows)
        start = time.perf_counter()
        out = prepare_dataset(dataset, tokenizer, task, plugins=plugins, max_length=args.max_length)
        seconds = time.perf_counter() - start
        tokens = sum(map(len, out["input_ids"]))
        prepared[name] = out
        print(f"  {name:<38}{len(out) / seconds:>10.0f}{tokens / seconds:>12.0f}{tokens:>10}")

    dataset = prepared["standard text -> language_modeling"]
    lengths = [len(ids) for ids in dataset["input_ids"]]
    quantiles = sorted(lengths)
    print(f"\npacking the standard-text dataset: lengths min {quantiles[0]}, median {quantiles[len(quantiles) // 2]}, "
          f"p95 {quantiles[int(0.95 * len(quantiles))]}, max {quantiles[-1]} tokens")
    print(f"  {'layout':<34}{'rows':>8}{'efficiency':>12}{'tokens kept':>13}{'seconds':>9}")
    eff, rows = unpacked_efficiency(lengths, args.batch_size, args.max_length, args.seed)
    print(f"  {f'no packing (batch {args.batch_size}, pad to longest)':<34}{rows:>8}{100 * eff:>11.1f}%{100.0:>12.1f}%{0:>9.2f}")
    for strategy in ("bfd", "bfd_split", "wrapped"):
        start = time.perf_counter()
        packed = pack_dataset(dataset, strategy, args.max_length, plugins=plugins)
        seconds = time.perf_counter() - start
        kept = sum(map(len, packed["input_ids"]))
        eff = packing_efficiency([kept], len(packed), args.max_length)
        print(f"  {'packing.' + strategy:<34}{len(packed):>8}{100 * eff:>11.1f}%{100 * kept / sum(lengths):>12.1f}%{seconds:>9.2f}")


if __name__ == "__main__":
    main()
