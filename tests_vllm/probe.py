"""What the engine script reads of each rank's live model (imported by every vLLM process)."""

from __future__ import annotations


def kept(model) -> dict[str, list]:
    """Every non-empty tensor of the model's state dict on this rank: shape, dtype, SHA-256 of its
    bytes. On CPU, vLLM repacks the linears after loading (their ``weight`` becomes empty): what
    stays is what the engine keeps as loaded (embeddings, norms, lm_head, biases, scales)."""
    import hashlib

    import torch

    out = {}
    for name, t in model.state_dict().items():
        if t.numel():
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[name] = [list(t.shape), str(t.dtype), hashlib.sha256(raw).hexdigest()]
    return out
