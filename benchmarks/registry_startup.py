"""How fast the registry answers: `plait --help`, `plait list losses`, `plait plugins` (wall time
and peak RSS of the whole process), with an empty catalog (the first listing after an install or an
edit imports every plugin) and with a current one (what every later listing costs).

    python benchmarks/registry_startup.py [--repeat 5]

For scale it also times what a run pays anyway: `from plait import DPOTrainer`. Each measurement is
a fresh process; the median of --repeat runs is reported. Writes benchmarks/results/registry_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "registry_startup.json"
PLAIT = str(Path(sys.executable).parent / "plait")
COMMANDS = {
    "plait --help": [PLAIT, "--help"],
    "plait list losses": [PLAIT, "list", "losses"],
    "plait plugins": [PLAIT, "plugins"],
    "from plait import DPOTrainer": [sys.executable, "-c", "from plait import DPOTrainer"],
}


def measure(argv: list[str], cache_dir: str) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PLAIT_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1"})
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    assert os.waitstatus_to_exitcode(status) == 0, argv
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results = {"load_average": os.getloadavg()[0], "cpus": os.cpu_count(), "commands": {}}
    for name, argv in COMMANDS.items():
        cold = [measure(argv, tempfile.mkdtemp(prefix="plait-cold-")) for _ in range(2)]
        warm_dir = tempfile.mkdtemp(prefix="plait-warm-")
        measure([PLAIT, "list", "methods"], warm_dir)  # records the catalog
        warm = [measure(argv, warm_dir) for _ in range(args.repeat)]
        row = {
            "empty_catalog_s": statistics.median(s for s, _ in cold),
            "empty_catalog_mib": statistics.median(m for _, m in cold),
            "s": statistics.median(s for s, _ in warm),
            "mib": statistics.median(m for _, m in warm),
        }
        results["commands"][name] = row
        print(f"{name:30s} {row['s']:5.2f} s {row['mib']:6.0f} MiB   (empty catalog: "
              f"{row['empty_catalog_s']:5.2f} s {row['empty_catalog_mib']:6.0f} MiB)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
