"""The Triton kernels compile for an H100/H200 (sm_90) without a GPU, through the GPU compiler.

Runs tests/compile_kernels.py in a subprocess without TRITON_INTERPRET (which
conftest.py sets on machines without a GPU): the interpreter runs the kernels'
maths but does not check them the way the GPU compiler does.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:  # Triton 3.2 has constants=
        pytest.skip("this Triton's ASTSource predates constexprs= (the GPU machine's Triton 3.6 has it)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "tests/compile_kernels.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert sum(line.startswith("query_merge") for line in lines) == 18 and sum("merge extra" in x for x in lines) == 4
