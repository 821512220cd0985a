"""AutoEP (expert-parallel MoE) training entry point launched by ``scripts/make_fixtures.py``.

Not meant to be run by hand. Usage (through the ``deepspeed`` launcher)::

    deepspeed --num_gpus N --no_local_rank --master_port PORT \
        scripts/_fixture_autoep.py --spec SPEC.json

The spec and the training loop are ``_fixture_train.py``'s (a tiny ``transformers`` MoE such as
Mixtral, built from its config after seeding; ``ds_config`` carries
``"expert_parallel": {"enabled": true, "autoep_size": N, "preset_model": "mixtral"}``). The only
addition is the patch ``transformers_can_record_registry_default``, which the spec must list.

Why the patch: DeepSpeed 0.19.8's AutoEP (``module_inject/auto_ep_presets/base.py``) saves and
restores entries of transformers' ``_CAN_RECORD_REGISTRY`` with ``registry.get(key, default)``,
but in transformers 5.24 ``_CanRecordRegistry.get(self, model)`` takes a model and no default, so
``deepspeed.initialize`` fails with ``_CanRecordRegistry.get() takes 2 positional arguments but 3
were given``. The patched ``get`` keeps transformers' behaviour for a model and treats a string key
(what DeepSpeed passes: ``str(module.__class__)``) as a plain ``dict`` lookup with a default.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _fixture_train  # noqa: E402

_MISSING = object()


def _patch_can_record_registry_default():
    from transformers.utils import output_capturing

    cls = output_capturing._CanRecordRegistry
    original = cls.get

    def get(self, key, default=_MISSING):
        if isinstance(key, str):  # DeepSpeed AutoEP's save/restore of one registry entry
            return dict.get(self, key, None if default is _MISSING else default)
        return original(self, key)

    cls.get = get


_fixture_train.PATCHES["transformers_can_record_registry_default"] = _patch_can_record_registry_default

if __name__ == "__main__":
    _fixture_train.main()
