"""The docs build as a site with mkdocs in strict mode: every relative link
and anchor resolves, and every page under docs/ is in mkdocs.yml's nav."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_build_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra (.ci/setup installs it)")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_docs_page_is_in_the_nav():
    """Strict mode only warns of a page left out of the nav when
    ``validation.omitted_files`` says so; this says it regardless."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    missing = [page for page in pages if f": {page}\n" not in nav]
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"
