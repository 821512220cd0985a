"""What importing reshard does to the interpreter: as a library, nothing until a name is used
(each public name loads its own module); as the ``reshard`` command, the command's modules are
imported with the collector off, frozen out of its way, and collection is back on."""

from __future__ import annotations

import subprocess
import sys

import reshard


def _run(*args: str) -> list[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True).stdout.split()


def test_a_library_import_loads_nothing_and_leaves_the_collector_alone():
    out = _run("-c", "import gc, sys, reshard; print(gc.isenabled(), gc.get_freeze_count() > 0, "
               "'torch' in sys.modules, sorted(m for m in sys.modules if m.startswith('reshard')))")
    assert out == ["True", "False", "False", "['reshard']"]


def test_a_program_run_with_dash_m_that_imports_reshard_keeps_its_collector(tmp_path):
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "__init__.py").write_text("import reshard  # noqa: F401\n")
    (tmp_path / "probe" / "__main__.py").write_text("import gc; print(gc.isenabled())")
    out = subprocess.run([sys.executable, "-m", "probe"], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    assert out.split() == ["True"]


def test_a_script_whose_arguments_say_dash_m_reshard_keeps_its_collector(tmp_path):
    (tmp_path / "train.py").write_text("import gc, reshard; print(gc.isenabled())")
    assert _run(str(tmp_path / "train.py"), "-m", "reshard") == ["True"]
    assert _run("-c", "import gc, reshard; print(gc.isenabled())", "-m", "reshard") == ["True"]


def test_every_public_name_resolves_to_its_object():
    assert sorted([*reshard.__all__, "open"]) == sorted(reshard._EXPORTS)
    for name in reshard.__all__:
        assert getattr(reshard, name) is not None
    from reshard.jobs.convert import convert
    from reshard.jobs.convert import reshard as reshard_fn
    from reshard.layouts.derive import derive

    # a submodule named like its function: the package's name stays the function
    assert reshard.convert is convert and reshard.derive is derive and reshard.reshard is reshard_fn
    assert "convert" in dir(reshard)
    assert not hasattr(reshard, "no_such_name")


def test_the_command_freezes_what_its_modules_made():
    probe = ("import gc, sys; sys.argv = ['reshard', 'convert', 'in', 'out']; import reshard.cli as cli; "
             "cli._cmd_convert = lambda args: print(gc.isenabled(), gc.get_freeze_count() > 100_000, "
             "'torch' in sys.modules, 'reshard.formats.deepspeed.writer' in sys.modules) or 0; cli.run()")
    assert _run("-c", probe) == ["True", "True", "True", "False"]
    # python -m reshard, as torchrun starts it: the collector is off from the package's import on
    assert _run("-m", "reshard", "--help")[:2] == ["usage:", "reshard"]
