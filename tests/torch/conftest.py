"""The byte path's tests run in vLLM's interpreter (torch); the repository root and ``tools/`` are
importable."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for p in (str(REPO), str(REPO / "tools")):
    if p not in sys.path:
        sys.path.insert(0, p)
