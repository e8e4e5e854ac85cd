"""The benchmark plots (bench/plots.py), drawn from results shaped as the
benchmarks write them, with the ratios they print checked in the SVG's text."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
pytest.importorskip("matplotlib", reason="the plots need matplotlib (the test extra has it)")


def _plots():
    spec = importlib.util.spec_from_file_location("plots", BENCH / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stats(samples):
    ordered = sorted(samples)
    return {"n": len(ordered), "p50": ordered[len(ordered) // 2],
            "p99": ordered[-1] if len(ordered) >= 10 else None,
            "min": ordered[0], "max": ordered[-1]}


def _row(samples):
    return {"label": "", "samples": samples, "detail": [], "stats": _stats(samples)}


def store_results(steps=20):
    rows = {"full_copy": _row([5.0, 5.2, 5.1]), "reflink_clone": _row([0.007, 0.008, 0.006]),
            "commit": _row([0.01 + 0.001 * i for i in range(steps // 2)]),
            "commit_tracked": _row([0.012] * (steps // 2)),
            "restore_in_place": _row([0.3] * 10), "restore_in_place_tracked": _row([0.4] * 10),
            "restore_fork": _row([0.5] * 10), "restore_depth_1": _row([0.02] * 5),
            "restore_depth_1_tracked": _row([0.0125] * 5),
            f"restore_depth_{steps}": _row([0.1] * 5),
            f"restore_depth_{steps}_tracked": _row([0.025] * 5)}
    return {"meta": {"steps": steps, "image_size": 2**32}, "rows": rows}


def vm_results():
    pause = [0.030, 0.025, 0.040, 0.035]
    copy = [2.0, 2.5]
    return {"checkpoint_paused": _stats(pause) | {"samples": pause},
            "full_copy_paused": _stats(copy) | {"samples": copy},
            "restore_undo": _stats([0.2]), "restore_swap": _stats([0.25]),
            "restore_reboot": _stats([3.0]), "fork": _stats([2.9]),
            "restore_full_copy": _stats([9.0]), "machine": {"accel": "tcg"}}


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_the_store_figure_shows_every_row_and_its_ratio(tmp_path):
    png, svg = _plots().store_figure(store_results(), tmp_path / "store")
    width, height = _png_size(png)
    assert width > height > 300
    text = svg.read_text()
    for label in ("commit (extent map)", "commit, tracked (written ranges)",
                  "full copy: 5,100.0 ms", "undo at depth 20, tracked", "fork into a new image"):
        assert label in text, label
    # full copy p50 5.1 s over each restore's p50
    for ratio in ("255× faster", "408× faster", "51× faster", "204× faster", "17× faster",
                  "13× faster", "10× faster"):
        assert ratio in text, ratio


def test_the_vm_figure_shows_pauses_and_restores_against_a_cold_boot(tmp_path):
    png, svg = _plots().vm_figure(vm_results(), tmp_path / "vm")
    assert _png_size(png)[0] > 300
    text = svg.read_text()
    assert "checkpoint (commit): p50 35 ms" in text and "full-copy snapshot: p50 2,500 ms" in text
    for ratio in ("45× faster", "36× faster", "3× faster"):
        assert ratio in text, ratio


def test_the_same_results_draw_the_same_svg(tmp_path):
    plots = _plots()
    first = plots.store_figure(store_results(), tmp_path / "a")[1].read_text()
    second = plots.store_figure(store_results(), tmp_path / "b")[1].read_text()
    assert first == second


def test_the_command_refuses_results_of_the_other_benchmark(tmp_path):
    results = tmp_path / "vm.json"
    results.write_text(json.dumps(vm_results()))
    done = subprocess.run([sys.executable, str(BENCH / "plots.py"), "store", str(results),
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 2 and "is not store_bench.py output" in done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "out.png").exists()
