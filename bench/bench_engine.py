"""Superseded by ``itif bench`` (the package ``itif.bench``); this script forwards to it.

    python bench/bench_engine.py --models bert-tiny bert-base --tenants 4
    # is
    itif bench --models bert-tiny bert-base --tenants 4

See ``itif bench --help`` and docs/performance.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from itif.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
