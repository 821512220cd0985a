"""Let Megatron-Core 0.19.2 (and the ``megatron.training`` package shipped in its wheel) run on a
CPU-only machine with ``gloo``, in a Python 3.11 venv without Transformer Engine, Apex or Triton.

Call :func:`install` before anything imports ``megatron``. Nothing here changes what a checkpoint
holds; it lets code that insists on CUDA (or on Python 3.12, or on TE/Apex) run:

0. ``typing.override`` (Python 3.12; ``megatron.training.models`` imports it) from
   ``typing_extensions``.
1. ``megatron.core.transformer.moe.ops.paged_stash`` does a bare ``import triton`` (its kernels
   serve only MoE "paged stash"): a stub with the three names ``moe.paged_stash`` imports goes
   into ``sys.modules`` (a fake top-level ``triton`` would break ``torch._dynamo``).
2. ``torch.cuda``: ``synchronize`` and ``empty_cache`` are no-ops, ``current_device()`` is
   ``'cpu'`` (so ``torch.empty(..., device=torch.cuda.current_device())`` allocates on CPU),
   ``Stream`` / ``Event`` / ``current_stream`` / ``stream`` are synchronous dummies (DDP and
   Megatron-LM's ``get_model`` create streams), and the CUDA RNG functions
   (``get_rng_state``, ``set_rng_state``, ``manual_seed``) act on a CPU ``torch.Generator`` of
   their own that stands in for the GPU's, so ``model_parallel_cuda_manual_seed`` and the
   tensor-parallel RNG tracker (dot-product attention always forks it) work as on a GPU, and
   ``get_rng_state`` in ``megatron/training/checkpointing.py`` saves that generator's state as
   ``cuda_rng_state``.
3. A ``TorchFunctionMode`` maps ``device='cuda'`` (``cuda:N``, ``torch.device('cuda')``) in
   factory calls and ``.to()`` to CPU, makes ``Tensor.cuda()`` return the tensor itself and makes
   ``Tensor.type()`` (no arguments) answer ``torch.cuda.<X>Tensor``: the distributed optimizer
   groups parameters by that string and asserts it names a CUDA type.
4. Megatron's own tracker helpers ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (on a CPU
   build the latter would queue its call forever in ``torch.cuda._lazy_call``) use that generator.
5. The MoE ``alltoall`` dispatcher turns split sizes into numpy arrays only for CUDA tensors; CPU
   ones too (``all_to_all_single`` rejects tensors there).
6. Sequence parallelism (which Megatron wants with TP x EP) on the local spec: without Apex the
   norms are ``WrappedTorchNorm`` (torch's ``RMSNorm``), which asserts ``not
   config.sequence_parallel``; it is built as without, and its parameters get the
   ``sequence_parallel`` attribute Apex's ``FusedLayerNorm`` sets, so ``finalize_model_grads``
   all-reduces their gradients over TP as it does for Apex's norms.
7. A Megatron 0.19.2 bug on the no-Apex/TE path (torch's Adam keeps a per-parameter ``step``):
   loading ``fully_reshardable`` or legacy ``distrib_optim.pt`` optimizer state fails with
   ``KeyError: 'step'`` in ``DistributedOptimizer._set_main_param_and_optimizer_states``; it is
   handed the step it already holds. (Training never calls it.)

Start-up only pieces (``device_count() == 1`` while ``initialize_megatron`` runs, a compute
capability for ``validate_args``) and the optimizer-load work-arounds that need Megatron objects
live in ``_megatron_common.py``.
"""

from __future__ import annotations

import contextlib
import sys
import types
import typing

_INSTALLED = False
_CUDA_GENERATOR = None


def _stub_paged_stash_ops() -> None:
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.GLOBAL_BLOCK_SIZE = 1024

    def _no_triton(*args, **kwargs):
        raise RuntimeError("paged_stash Triton kernels are stubbed out on CPU (scripts/_megatron_cpu.py)")

    mod.paged_stash_copy_kernel = _no_triton
    mod.paged_stash_pop_kernel = _no_triton
    mod.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[name] = mod


def _is_cuda(dev) -> bool:
    import torch

    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


def install() -> None:
    """Apply the patches (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch
    from torch.overrides import TorchFunctionMode

    global _CUDA_GENERATOR
    _CUDA_GENERATOR = torch.Generator()

    if not hasattr(typing, "override"):  # Python 3.12's typing.override, used by megatron.training.models
        import typing_extensions

        typing.override = typing_extensions.override
    _stub_paged_stash_ops()

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.empty_cache = lambda: None

    # The "CUDA" generator is a CPU torch.Generator of its own (so the tracker's forks never
    # disturb the CPU default generator, as on a GPU).
    def _get_state(*a, **k):
        return _CUDA_GENERATOR.get_state()

    def _set_state(state, *a, **k):
        _CUDA_GENERATOR.set_state(state)

    def _seed(seed, *a, **k):
        _CUDA_GENERATOR.manual_seed(int(seed))

    for mod in (torch.cuda, torch.cuda.random):
        mod.get_rng_state = _get_state
        mod.set_rng_state = _set_state
        mod.manual_seed = _seed
        mod.manual_seed_all = _seed

    class _Stream:  # torch.cuda.Stream / Event stand-in: CPU work is synchronous
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def wait_event(self, *a, **k):
            pass

        def record_event(self, *a, **k):
            return _Stream()

        def record(self, *a, **k):
            pass

        def wait(self, *a, **k):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Stream
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    tensor_type = torch.Tensor.type
    tensor_cuda = torch.Tensor.cuda
    tensor_to = torch.Tensor.to

    class _CpuForCuda(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is tensor_cuda:
                return args[0]
            if func is tensor_type and len(args) == 1 and not kwargs:
                return "torch.cuda." + tensor_type(args[0]).split(".")[-1]
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs["device"] = "cpu"
            if func is tensor_to:
                args = tuple("cpu" if _is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    mode = _CpuForCuda()
    mode.__enter__()  # stays on for the life of the process

    # Megatron's tensor-parallel RNG tracker sets/gets "CUDA" states through its own helpers
    # (which, on a CPU build, would queue the call forever in torch.cuda._lazy_call).
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: _CUDA_GENERATOR.get_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: _CUDA_GENERATOR.set_state(new_state)

    # The alltoall MoE token dispatcher hands its split sizes to all_to_all_single as numpy
    # arrays, made by maybe_move_tensor_to_cpu(..., as_numpy=True) -- which converts only CUDA
    # tensors; a CPU tensor would reach all_to_all_single as a tensor, which it rejects.
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    move = dispatcher.maybe_move_tensor_to_cpu

    def _move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    dispatcher.maybe_move_tensor_to_cpu = _move

    # Without Apex / Transformer Engine the distributed optimizer wraps torch's Adam, whose state
    # holds a "step" tensor per parameter; DistributedOptimizer.load_state_dict sets it from the
    # saved param groups, and _set_main_param_and_optimizer_states then copies every state
    # tensor from the loaded ones -- but the fully_reshardable and dp_zero_gather_scatter (legacy
    # distrib_optim.pt) loaders hand it no "step", so it fails with KeyError('step') (0.19.2).
    # Hand it the step it already holds (a copy onto itself), so the rest loads as written.
    from megatron.core.optimizer import distrib_optimizer

    set_states = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state.get(main_param, {}).get("step")
        if torch.is_tensor(step) and "step" not in tensors:
            tensors = {**tensors, "step": step.clone()}
        return set_states(self, model_param, tensors)

    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = _set_states
    _allow_sequence_parallel_norms()
    _INSTALLED = True


def _allow_sequence_parallel_norms() -> None:
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def _new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build(cls, plain, hidden_size, eps, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = _new
