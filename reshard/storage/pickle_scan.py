"""What a pickle would import, found without running it: the check a file copied verbatim
gets (``storage.copy_check``), since nothing unpickles it there.

``globals_in`` walks the opcodes (``pickletools``) and collects every ``GLOBAL``, ``INST`` and
``STACK_GLOBAL`` (whose module and name are the two strings pushed before it, possibly through
the memo). ``refused`` says which of them a policy does not admit:

* ``"weights"``: what ``torch.load(weights_only=True)`` with reshard's stand-ins admits in the
  files DeepSpeed and reshard write (tensor rebuilds, storage types, dtypes, ``torch.Size``,
  ``OrderedDict``, DeepSpeed's helper classes);
* ``"trainer"``: that, and what a Hugging Face Trainer pickles beside a checkpoint
  (``TrainingArguments`` and the classes it holds from ``transformers`` and ``accelerate``;
  numpy's RNG state in ``rng_state*.pth``);
* ``"megatron"``: the weights' set, and what a legacy Megatron file holds beside its tensors
  (``args`` as an ``argparse.Namespace``, ``signal.Signals``, numpy's RNG state, and the Megatron
  enums reshard loads as inert stand-ins: ``formats.megatron.safe``).

Nothing here imports torch (the command's early copies run before it loads)."""

from __future__ import annotations

import pickletools
import re

from ..errors import CheckpointError

__all__ = ["POLICIES", "globals_in", "policy_for", "refused"]

POLICIES = ("weights", "trainer", "megatron")

_TORCH = {
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("collections", "Counter"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "complex"),
    ("builtins", "slice"), ("_codecs", "encode"),
    # DeepSpeed's helper classes, which reshard loads as inert stand-ins (storage.safe_load)
    ("deepspeed.utils.tensor_fragment", "fragment_address"), ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
}
_TORCH_NAME = re.compile(r"^(?:[A-Za-z0-9]+Storage|UntypedStorage|float\d*|bfloat16|half|double|u?int\d+|long|short|"
                         r"bool|complex\d+|cfloat|cdouble|float8_\w+|strided|sparse_\w+|contiguous_format|"
                         r"preserve_format|channels_last\w*)$")
_NUMPY = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
          ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "ndarray"),
          ("numpy", "dtype")}
_NUMPY_DTYPES = re.compile(r"^numpy\.dtypes$")
_TRAINER_MODULES = ("transformers.", "accelerate.")
_TRAINER_FILES = re.compile(r"^(?:training_args\.bin|rng_state(?:_\d+)?\.pth|scheduler\.pt|scaler\.pt)$")
_MEGATRON_FILES = re.compile(r"^(?:model_optim_rng|distrib_optim)\.pt$")
_MEGATRON = {("argparse", "Namespace"), ("signal", "Signals"), ("megatron.core.enums", "ModelType"),
             ("megatron.core.transformer.enums", "AttnBackend"),
             ("megatron.core.transformer.enums", "InferenceCudaGraphScope"),
             ("megatron.core.rerun_state_machine", "RerunMode"), ("megatron.core.rerun_state_machine", "RerunState"),
             ("megatron.core.rerun_state_machine", "RerunDiagnostic")}
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


def policy_for(name: str) -> str:
    """The policy a copied file's pickle is held to, by its file name."""
    base = name.rsplit("/", 1)[-1]
    return "trainer" if _TRAINER_FILES.match(base) else "megatron" if _MEGATRON_FILES.match(base) else "weights"


def globals_in(data: bytes, where: str) -> set[tuple[str, str]]:
    """Every (module, name) the pickle ``data`` imports; a pickle that does not parse is a
    :class:`CheckpointError` naming ``where``."""
    found: set[tuple[str, str]] = set()
    memo: dict[int, object] = {}
    recent: list[object] = []  # the last values pushed (strings, for STACK_GLOBAL)
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found.add((module, attr))
            elif name == "STACK_GLOBAL":
                if len(recent) < 2 or not all(isinstance(x, str) for x in recent[-2:]):
                    raise CheckpointError(f"{where}: a STACK_GLOBAL whose module and name cannot be read without "
                                          "running the pickle")
                found.add((str(recent[-2]), str(recent[-1])))
            elif name in _STRINGS:
                recent.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = recent[-1] if recent else None
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                recent.append(memo.get(int(arg)))
            elif name != "STOP":
                recent.append(None)
            del recent[:-4]
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- a corrupt pickle fails in pickletools in many ways
        raise CheckpointError(f"{where}: corrupt pickle ({type(e).__name__}: {e})") from None
    return found


def refused(found: set[tuple[str, str]], policy: str) -> list[str]:
    """The globals of ``found`` that ``policy`` does not admit, as ``module.name``, sorted."""
    out = []
    for module, name in found:
        if (module, name) in _TORCH or (module == "torch" and _TORCH_NAME.match(name)):
            continue
        if policy in ("trainer", "megatron") and ((module, name) in _NUMPY or _NUMPY_DTYPES.match(module)):
            continue
        if policy == "trainer" and module.startswith(_TRAINER_MODULES):
            continue
        if policy == "megatron" and (module, name) in _MEGATRON:
            continue
        out.append(f"{module}.{name}")
    return sorted(out)
