"""The soak: a 30-minute job on machines that fail every minute on average, on the shipped
defaults (the one key a user sets, `checkpoint.mtbf_seconds`), without the baseline; it
must finish, and it prints its goodput and every resume decision.

    python benchmarks/soak_mtbf.py [--job-seconds 1800] [--mtbf 60] [--seed 1]

The same run as `bench_goodput.py --job-seconds 1800 --mtbf 60 --baseline-cap 0`; any of its
options may be given.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_goodput  # noqa: E402

SOAK = ["--job-seconds", "1800", "--mtbf", "60", "--seed", "1", "--baseline-cap", "0"]

if __name__ == "__main__":
    sys.argv[1:] = SOAK + sys.argv[1:]  # later options win
    sys.exit(bench_goodput.main())
