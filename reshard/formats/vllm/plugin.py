"""vLLM's entry point into reshard (``vllm.general_plugins`` in pyproject.toml): every vLLM process
calls :func:`register`, which makes the weight-transfer backend "reshard" known to both factories.
The only module vLLM imports of reshard at start; the engines load when a backend is built."""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in ((WeightTransferEngineFactory, "ReshardWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "ReshardTrainerWeightTransferEngine")):
        module = "reshard.formats.vllm." + ("engine" if factory is WeightTransferEngineFactory else "trainer")
        try:
            factory.register_engine("reshard", module, cls)
        except ValueError:  # registered already (plugins load once per process, but be safe)
            pass
