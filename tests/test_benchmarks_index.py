"""benchmarks/README.md lists every script in benchmarks/ under a purpose, and names no script that is gone."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_benchmark_script_is_in_the_index_and_every_entry_is_a_script() -> None:
    index = (BENCHMARKS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_0-9]+\.py)` \|", index, flags=re.MULTILINE))
    scripts = {path.name for path in BENCHMARKS.glob("*.py")}
    assert sorted(scripts - listed) == [], "add these to benchmarks/README.md under their purpose"
    assert sorted(listed - scripts) == [], "benchmarks/README.md lists scripts that do not exist"
    headings = re.findall(r"^## (.+)$", index, flags=re.MULTILINE)
    assert headings == ["Headline results", "Diagnostics", "Calibration", "Helper modules"]
