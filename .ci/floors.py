"""Print the lowest versions pyproject.toml declares for plait's dependencies, pinned (``name==floor``),
for ``make test-min``: a floor is only as true as the suite that ran on it. torch is left out: the
Makefile installs TORCH_SPEC first, which on this machine is the floor itself."""

import re
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
print(" ".join(re.sub(r">=", "==", spec) for spec in project["dependencies"] if not spec.startswith("torch")))
