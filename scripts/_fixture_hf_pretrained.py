"""``save_pretrained`` folders of the HF fixtures (one process, no training), run by
``scripts/make_hf_fixtures.py``; not meant to be run by hand::

    python scripts/_fixture_hf_pretrained.py --spec SPEC.json

``SPEC.json``: ``{"recipe": {...}, "output_dir": ..., "reference_dir": ..., "report_path": ...}``
with the recipe of ``_fixture_hf_recipe.pretrained_recipe``.

The model is the recipe's initialisation (``build_model`` after ``set_seed(seed)``) in the
recipe's dtype, saved with ``model.save_pretrained(output_dir[, max_shard_size=...])`` and the
tokenizer with ``tokenizer.save_pretrained(output_dir)``. Reference tensors
(``reference_dir``): ``model.safetensors`` (every ``state_dict()`` key, tied ones as copies, in
the model's dtype) and ``logits.safetensors`` (the probe batch and the model's logits, eval mode).
The folder is then loaded back with ``AutoModelForCausalLM.from_pretrained`` and its logits and
weights compared with the references (the report records the result).
"""

# ruff: noqa: E402
import argparse
import json
import os
import sys
import time

T0 = time.time()

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fixture_hf_recipe as R


def logits_of(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.detach().clone().contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.load(open(ap.parse_args().spec))
    recipe = spec["recipe"]
    R.offline_env()
    R.deterministic_torch()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, recipe["dtype"])
    model = R.build_model(recipe, dtype=dtype)
    tokenizer = R.build_tokenizer()
    out = spec["output_dir"]
    kwargs = {"max_shard_size": recipe["max_shard_size"]} if recipe.get("max_shard_size") else {}
    model.save_pretrained(out, **kwargs)
    tokenizer.save_pretrained(out)

    ids = R.probe_ids(recipe)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    logits = logits_of(model, ids)
    ref = spec["reference_dir"]
    os.makedirs(ref, exist_ok=True)
    save_file(weights, os.path.join(ref, "model.safetensors"))
    save_file({"input_ids": ids, "logits": logits}, os.path.join(ref, "logits.safetensors"))

    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=dtype)
    back = loaded.state_dict()
    report = {
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "state_dict_keys": list(weights),
        "tied": {k: n for k, n in [("lm_head.weight", "model.embed_tokens.weight")]
                 if model.lm_head.weight is model.model.embed_tokens.weight},
        "from_pretrained": {
            "class": f"{type(loaded).__module__}.{type(loaded).__qualname__}",
            "dtype": str(next(loaded.parameters()).dtype),
            "weights_equal": sorted(back) == sorted(weights) and all(torch.equal(back[k], weights[k]) for k in weights),
            "logits_equal": bool(torch.equal(logits_of(loaded, ids), logits)),
        },
        "seconds": time.time() - T0,
    }
    with open(spec["report_path"], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
