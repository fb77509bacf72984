"""The pure Infiniswap modules import without the built C core (``infiniswap._core``)."""
from __future__ import annotations

import subprocess
import sys

BLOCK_CORE = """
import importlib.abc, sys
class NoCore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "infiniswap._core":
            raise ImportError("the C core is not built")
sys.meta_path.insert(0, NoCore())
"""


def test_pure_modules_import_without_the_c_core():
    code = BLOCK_CORE + ("import infiniswap.placement, infiniswap.eviction, infiniswap.protocol, infiniswap.report\n"
                         "import infiniswap.fencing\n"
                         "assert 'infiniswap._core' not in sys.modules\n"
                         "import infiniswap\n"
                         "try:\n"
                         "    infiniswap.Device\n"
                         "except ImportError as e:\n"
                         "    print('device needs the core:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "device needs the core" in out.stdout


def test_package_attributes_are_still_there():
    import infiniswap
    from infiniswap.device import Device
    assert infiniswap.Device is Device and "Daemon" in dir(infiniswap)
