"""The torchrun example runs as documented and matches the oracle."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "torchrun_dcp_step.py"


def test_torchrun_example():
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(EXAMPLE), "--interleave", "4"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    errs = [float(e) for e in re.findall(r"max_rel_err vs oracle (\S+)", r.stdout)]
    assert len(errs) == 2 and max(errs) < 1e-5, r.stdout


def test_torchrun_example_refuses_a_group_that_does_not_divide_the_heads():
    # refused by name before the process group starts (it once raised after init_process_group)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode != 0 and "error: expected a group size that divides the 16 heads, got 3 ranks" in r.stderr
