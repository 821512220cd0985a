"""The trainer side's error when vLLM's own RPC failed too (no engine started: ``_Rpc`` only)."""

from __future__ import annotations

import time

from reshard.errors import MapError


def test_a_failed_engine_rpc_is_named_without_changing_the_trainers_error_class():
    """Found by make test-vllm (a race): when vLLM's failed init RPC came back before the trainer's
    own MapError (a parameter the engine lacks), the trainer raised a TransferError instead; now the
    error keeps its class and fields, the engine's report appended."""
    from reshard.errors import TransferError
    from reshard.formats.vllm.trainer import _Rpc

    def fails(_arg):
        raise RuntimeError("There is no module or parameter named 'layers.0.mlp.extra_proj'")

    rpc = _Rpc(fails, None)
    while not rpc.future.done():
        time.sleep(0.01)
    e = rpc.why(MapError("vLLM worker 0 could not load the markers", path="layers.0.mlp.extra_proj"))
    assert type(e) is MapError and "layers.0.mlp.extra_proj" in str(e) and "the engine reported" in str(e)
    assert type(rpc.why(TransferError("update 3 failed"))) is TransferError
    assert _Rpc(None, None).why(e) is e
