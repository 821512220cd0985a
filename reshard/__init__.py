"""reshard: move distributed-training checkpoints between parallel topologies exactly.

The centre is an affine IR (``reshard.ir``): a parameter's map says, for every rank, which
affine blocks of the full tensor F its shard holds. See docs/spec.md.
"""

import gc as _gc
import importlib as _importlib
import os as _os
import sys as _sys
import types as _types

__version__ = "0.1.0"


def _as_command() -> bool:
    """Whether this process is the ``reshard`` command (the script, or ``python [flags] -m reshard``
    as torchrun starts it), not a program that imports reshard."""
    if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "reshard":
        return True
    if _sys.argv[:1] != ["-m"]:  # what it is while ``python -m`` imports the module's package
        return False
    argv = list(getattr(_sys, "orig_argv", ()))
    return "-m" in argv and argv[argv.index("-m") + 1:][:1] in (["reshard"], ["reshard.cli"])


# The command imports its modules with the collector off and turns it back on once they are
# frozen (``cli.run``).
if _as_command():
    _gc.disable()

# Public name -> (module, attribute; None: the module itself), imported on first use (PEP 562):
# a command loads only what it runs, and ``reshard convert`` starts copying files before torch
# has loaded (``reshard.jobs.early_copies``).
_EXPORTS = {
    "layouts": (".layouts", None),
    "convert": (".jobs.convert", "convert"),
    "reshard": (".jobs.convert", "reshard"),
    "open": (".formats.registry", "open_reader"),
    "verify": (".storage.staging", "verify"),
    "derive": (".layouts.derive", "derive"),
    "hf_tp_plan": (".formats.hf.tp_plan", "tp_plan"),
    "plan": (".plan.planner", "plan"),
    "plan_model": (".plan.planner", "plan_model"),
    "plan_for_rank": (".plan.planner", "plan_for_rank"),
    "apply_plan": (".execute.local", "apply_plan"),
    "transfer": (".execute.live", "transfer"),
    "WeightSync": (".execute.sync", "WeightSync"),
    "Fp8Block": (".execute.sync_quant", "Fp8Block"),
    **{name: (".ir", name) for name in ("ParamMap", "Piece", "Shard", "View")},
    **{name: (".plan.values", name) for name in ("ModelPlan", "TransferPlan")},
    "Report": (".jobs.reports", "Report"),
    "ReshardError": (".errors", "ReshardError"),
}


def __getattr__(name: str):
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    module = _importlib.import_module(where[0], __name__)
    value = module if where[1] is None else getattr(module, where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(_types.ModuleType):
    """The import system binds each submodule it loads on its package; ``reshard.convert`` and
    ``reshard.derive`` are functions of modules of the same names, so those bindings are declined."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, _types.ModuleType) and _EXPORTS.get(name, (None, None))[1] is not None:
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

# ``open`` stays out of ``__all__``: a star import must not shadow the builtin
__all__ = [
    "apply_plan",
    "convert",
    "derive",
    "Fp8Block",
    "hf_tp_plan",
    "layouts",
    "ModelPlan",
    "ParamMap",
    "Piece",
    "plan",
    "plan_for_rank",
    "plan_model",
    "Report",
    "reshard",
    "ReshardError",
    "Shard",
    "transfer",
    "TransferPlan",
    "verify",
    "View",
    "WeightSync",
]
