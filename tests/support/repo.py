"""The checkout the tests run from, and what importing a part of it pulls in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def assert_import_leaves_out(modules: str, absent: set[str]) -> None:
    """In a fresh interpreter, `import {modules}` (from this checkout) loads none of `absent`."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        f"import {modules}; "
        f"assert not set({sorted(absent)!r}) & set(sys.modules), sorted(sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
