"""A warm start never traces (its executables come from the executable cache), so the engine's modules must
not import Pallas, whose import costs ~0.1-0.2 s of every start on the GPU machines; the kernels' modules are
imported where a forward is traced."""

import subprocess
import sys

from tests.conftest import ROOT


def test_engine_modules_do_not_import_pallas():
    code = ("import sys\nimport jinfer.engine.core, jinfer.engine.core_proc, jinfer.llm\n"
            "bad = sorted(m for m in sys.modules if 'pallas' in m)\n"
            "assert not bad, bad[:5]\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
