"""report.profile_step's profile: its table written, and kineto's native start/stop lines kept
off the console (they are printed on fd 2 whatever KINETO_LOG_LEVEL says)."""

from __future__ import annotations

import subprocess
import sys


def test_a_profiled_step_writes_its_table_and_no_native_lines(tmp_path):
    script = ("import sys, torch\n"
              "from pathlib import Path\n"
              "from r1fit.report.profile import step_profile\n"
              "print('before', file=sys.stderr, flush=True)\n"
              f"with step_profile(2, 2, Path({str(tmp_path)!r}), torch.device('cpu')):\n"
              "    with torch.profiler.record_function('r1fit/update'):\n"
              "        torch.ones(64, 64) @ torch.ones(64, 64)\n"
              "print('after', file=sys.stderr, flush=True)\n")
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stderr
    lines = [line for line in err.splitlines() if "step 2 profiled" not in line]
    assert lines[0] == "before" and lines[-1] == "after"
    assert "USDT" not in err
    table = (tmp_path / "profile-step-2.txt").read_text()
    assert "r1fit/update: CPU" in table and "aten::mm" in table
