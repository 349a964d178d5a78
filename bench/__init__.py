"""Benchmarks of anarchon: ``python -m bench --help``.

The benchmarks measure this checkout: its ``src/`` comes first on the import path
(here and in every process they start), whatever anarchon is installed.
"""

import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)
