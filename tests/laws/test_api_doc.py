"""docs/api.md is generated from the public API and kept current."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_api_reference_is_current():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_api_doc.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
