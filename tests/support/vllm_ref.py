"""A vLLM-style tensor-parallel Llama in plain torch, independent of reshard: how vLLM slices a
Hugging Face checkpoint into each TP rank's tensors (``engine_slices``, the reference every layout
builder and every sync is checked against) and a minimal forward over those tensors
(``tp_forward``, with the all-reduces a TP engine does)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

PAD_TO = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def padded_rows(vocab: int, tp: int) -> int:
    rows = -(-vocab // PAD_TO) * PAD_TO
    assert rows % tp == 0
    return rows


def kv_heads_of(rank: int, tp: int, kv: int) -> list[int]:
    if tp >= kv:
        return [rank // (tp // kv)]
    n = kv // tp
    return list(range(rank * n, (rank + 1) * n))


def engine_slices(full: dict[str, torch.Tensor], cfg, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors of vLLM's Llama at TP ``tp``, cut from HF's full tensors with
    ``torch`` slicing: ``qkv_proj`` = ``[q_r; k_r; v_r]`` (a key/value head on ``tp / kv`` ranks when
    TP exceeds the head count), ``gate_up_proj`` = ``[gate_r; up_r]``, ``o_proj``/``down_proj`` column
    chunks, embedding and head padded to a multiple of 64 rows then chunked, norms whole."""
    hq, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    out = {}
    for name, t in full.items():
        if "embed_tokens" in name or name == "lm_head.weight":
            rows = padded_rows(t.shape[0], tp)
            padded = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
            out[name] = padded.chunk(tp)[rank]
        elif "norm" in name:
            out[name] = t
        elif "o_proj" in name or "down_proj" in name:
            out[name] = t.chunk(tp, dim=1)[rank]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = full[p + "self_attn.q_proj.weight"].chunk(tp)[rank]
        heads = kv_heads_of(rank, tp, kv)
        k = torch.cat([full[p + "self_attn.k_proj.weight"][h * d:(h + 1) * d] for h in heads])
        v = torch.cat([full[p + "self_attn.v_proj.weight"][h * d:(h + 1) * d] for h in heads])
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([full[p + "mlp.gate_proj.weight"].chunk(tp)[rank],
                                                        full[p + "mlp.up_proj.weight"].chunk(tp)[rank]])
    return {n: t.contiguous() for n, t in out.items()}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)  # as HF's LlamaRMSNorm computes it
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def tp_forward(w: dict[str, torch.Tensor], ids: torch.Tensor, cfg, tp: int, rank: int, group,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` of the TP model whose rank-``rank`` tensors are ``w`` (any dtype;
    computed in ``dtype``). Row-parallel outputs and the vocabulary-parallel embedding are summed
    over ``group`` (``None``: ``tp`` is 1), the head's vocabulary chunks gathered."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    w = {n: t.to(dtype) for n, t in w.items()}
    hq, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    qh, kh = hq // tp, len(kv_heads_of(rank, tp, kv))
    emb = w["model.embed_tokens.weight"]
    lo = rank * emb.shape[0]
    local = ids - lo
    inside = (local >= 0) & (local < emb.shape[0])
    x = _sum(F.embedding(local.clamp(0, emb.shape[0] - 1), emb) * inside[..., None], group)
    b, s = ids.shape
    pos = torch.arange(s)[None].expand(b, s)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((s, s), float("-inf"), dtype=dtype).triu(1)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        qkv = h @ w[p + "self_attn.qkv_proj.weight"].T
        q, k, v = qkv.split([qh * d, kh * d, kh * d], dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        first_kv = kv_heads_of(rank, tp, kv)[0]
        group_of = [(rank * qh + j) // (hq // kv) - first_kv for j in range(qh)]  # local kv head of each q head
        k, v = k[:, group_of], v[:, group_of]
        att = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5 + mask, dim=-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, qh * d)
        x = x + _sum(o @ w[p + "self_attn.o_proj.weight"].T, group)
        h = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate, up = (h @ w[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        x = x + _sum((F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T, group)
    x = _rms(x, w["model.norm.weight"], cfg.rms_norm_eps)
    part = x @ w["lm_head.weight"].T
    if group is None:
        return part[..., :cfg.vocab_size]
    parts = [torch.empty_like(part) for _ in range(tp)]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :cfg.vocab_size]
