"""The core must import neither torch nor tensorflow (the adapters are optional)."""
import subprocess
import sys


def test_core_imports_no_framework():
    code = ("import sys, hvd_commopt, hvd_commopt.engine, hvd_commopt.comm, hvd_commopt.fusion, "
            "hvd_commopt.run, hvd_commopt.compression\n"
            "import pkgutil, importlib\n"
            "for m in pkgutil.walk_packages(hvd_commopt.__path__, 'hvd_commopt.'):\n"
            "    if m.name.endswith('__main__'): continue\n"
            "    importlib.import_module(m.name)\n"
            "bad = [m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
