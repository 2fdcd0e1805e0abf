"""The host side runs without a model: importing it must not import jax or flax."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cache_and_sched_import_no_jax():
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        "import jaxllm.cache, jaxllm.sched; "
        "assert not {'jax', 'flax'} & set(sys.modules), sorted(sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
