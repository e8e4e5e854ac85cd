"""How hard the tests try, set by one variable: ``BLOCKDIFF_TEST_BUDGET``.

- ``small``: the fast tier's size, a few examples and steps each, for the
  loop a contributor runs while working (see the README's fast tier);
- ``ci`` (the default): what ``python3 -m pytest`` and CI run;
- ``full``: the exhaustive sweeps (every kill point with every next step,
  thousands of fault steps, ten times the property examples), for a night.

Property tests take their example counts from ``examples(n)``; the race and
fault machines and the kill matrices read ``LEVEL`` or ``steps()``.
"""

from __future__ import annotations

import os

LEVELS = ("small", "ci", "full")
LEVEL = os.environ.get("BLOCKDIFF_TEST_BUDGET", "ci")
if LEVEL not in LEVELS:
    raise SystemExit(f"BLOCKDIFF_TEST_BUDGET={LEVEL!r}: expected one of {', '.join(LEVELS)}")
FULL = LEVEL == "full"
SMALL = LEVEL == "small"


def examples(n: int) -> int:
    """A property test's example count: `n` in CI, scaled for the others."""
    if SMALL:
        return max(5, n // 10)
    return n * 10 if FULL else n


def steps(*, small: int, ci: int, full: int) -> int:
    """A race or fault machine's step count at this level."""
    return {"small": small, "ci": ci, "full": full}[LEVEL]
