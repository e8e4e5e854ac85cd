"""A tiny run of bench/agent_bench.py on a scratch XFS (root, xfsprogs).
Skipped unless --run-bench is given:

    pytest bench/test_agent_bench.py --run-bench
"""

from __future__ import annotations

import json

import agent_bench
import pytest


@pytest.mark.bench
def test_tiny_run(tmp_path, capsys, scratch_xfs_possible):
    out = tmp_path / "out.json"
    assert agent_bench.main(["--steps", "5", "--image-mib", "16", "--no-vm", "--json", str(out),
                             "--workdir", str(tmp_path / "work")]) == 0
    assert "| image disk |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"no disk", "no disk, sealed", "image disk"}
    assert all(row["checkpoint"]["n"] == 5 for row in rows.values())
    assert rows["image disk"]["disk"]["p50"] > 0 == rows["no disk"]["disk"]["p50"]
