"""FP8 block encoding (``--quantize``): ``reshard.ir.codec.fp8_block_encode`` against transformers'
own ``Fp8Quantize`` on a 4096 x 4096 bf16 weight in 128 x 128 blocks, the same bits (checked), both
scale formats, at torch's default intra-op threads and at one."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.common import best_of, row
from reshard.ir.codec import fp8_block_encode


def main() -> list[str]:
    try:
        from transformers import FineGrainedFP8Config
        from transformers.integrations.finegrained_fp8 import Fp8Quantize
    except ImportError:
        return ["  (transformers not installed: skipped)"]
    x = (torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    out, default = [], torch.get_num_threads()
    for threads in sorted({default, 1}, reverse=True):
        torch.set_num_threads(threads)
        out.append(f"  (torch intra-op threads: {threads})")
        for fmt, theirs in (("float32", "float"), ("ue8m0", "ue8m0")):
            op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(scale_fmt=theirs)))
            want, (q, s) = op.convert({"w.weight": x}), fp8_block_encode(x, (128, 128), fmt)
            if not (torch.equal(q.view(torch.uint8), want["w.weight"].view(torch.uint8))
                    and torch.equal(s.view(torch.uint8), want["w.weight_scale_inv"].view(torch.uint8))):
                raise SystemExit(f"fp8_block_encode ({fmt}) differs from transformers' Fp8Quantize")
            ours = best_of(lambda fmt=fmt: fp8_block_encode(x, (128, 128), fmt))
            peer = best_of(lambda op=op: op.convert({"w.weight": x}))
            out.append(row(f"fp8 encode 4096x4096 bf16, {fmt} scales, vs Fp8Quantize", ours, peer,
                           note=f"({x.numel() / ours / 1e6:.0f} M elements/s)"))
    torch.set_num_threads(default)
    return out


if __name__ == "__main__":
    print("\n".join(main()))
