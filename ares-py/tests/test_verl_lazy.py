"""`import ares` and `import ares.verl` import neither verl nor torch (runs everywhere)."""

import subprocess
import sys


def test_import_ares_verl_imports_neither_verl_nor_torch():
    code = (
        "import sys, ares, ares.verl\n"
        "bad = [m for m in ('verl', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert 'ares_grpo' in ares.verl.ESTIMATORS and 'ares_vanilla' in ares.verl.POLICY_LOSSES\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
