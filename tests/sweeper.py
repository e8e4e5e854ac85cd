"""A process that sweeps stores beside a test's other operations.

``SWEEPER`` is the program (for ``python3 -c``): gc without a policy (only
the sweep) through the library, many times a second where a process per gc
manages a few, so it does what `blockdiff gc` does, more often. Arguments:
a stop file, a time limit in seconds, then the stores. It stops when the
stop file exists, when its parent is gone, or at the limit, and prints how
many sweeps it made.
"""

SWEEPER = r"""
import os, random, sys, time
from blockdiff.store.retention import Policy
from blockdiff.store.store import Store

stop, limit, parent = sys.argv[1], time.monotonic() + float(sys.argv[2]), os.getppid()
stores = [Store(path) for path in sys.argv[3:]]
rng = random.Random(0)
sweeps = 0
while not os.path.exists(stop) and time.monotonic() < limit and os.getppid() == parent:
    for store in stores:
        store.gc(Policy())
    sweeps += 1
    time.sleep(rng.uniform(0.001, 0.005))   # room for the others to take a lock
print(sweeps)
"""
