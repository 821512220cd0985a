"""What importing reshard does to the interpreter: as a library, nothing; as the ``reshard``
command (``python -m reshard``, as torchrun starts it), the objects of the import are frozen out
of the garbage collector's way and collection is back on."""

from __future__ import annotations

import subprocess
import sys

PROBE = "import gc, reshard; print(gc.isenabled(), gc.get_freeze_count() > 100_000)"


def test_a_library_import_leaves_the_collector_alone():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_the_command_freezes_what_the_import_made(tmp_path):
    (tmp_path / "probe").mkdir()
    # a package run with -m imports reshard while the interpreter's argv[0] is still "-m", as
    # ``python -m reshard`` does
    (tmp_path / "probe" / "__init__.py").write_text("import reshard  # noqa: F401\n")
    (tmp_path / "probe" / "__main__.py").write_text(PROBE)
    out = subprocess.run([sys.executable, "-m", "probe"], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    assert out.split() == ["True", "True"]
