#!/usr/bin/env python3
"""Reference logits for a "lite" DeepSeek-V2 (no q_lora_rank: one q_proj), from transformers.

The `deepseek_v2` fixture uses the low-rank q (q_lora_rank 32). This takes its weights (read back
from the f32 GGUF by ../deepseek2_yarn/make_ref.py's mapping, which is first checked against the
fixture's own `hf.logits`), replaces q_a_proj / q_a_layernorm / q_b_proj of every layer by one
q_proj whose values come from a formula the Rust test repeats exactly (see `q_weight`), sets
`q_lora_rank: null`, and records the logits of every prompt position and 16 greedy ids of
transformers' DeepseekV2ForCausalLM. The Rust test
(`deepseek2::tests::lite_query_matches_transformers`) rewrites the fixture GGUF the same way:
no `attention.q_lora_rank` key, no `attn_q_a*`/`attn_q_b`, an `attn_q` per layer.

Usage: python3 make_ref.py [FIXTURES_ROOT]   (default ../../../../../../shared/fixtures)
Needs: torch (CPU), transformers 5.24, gguf, numpy.
"""
import json
import math
import os
import sys

import numpy as np
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../deepseek2_yarn"))
from make_ref import state_dict  # noqa: E402  (the same GGUF -> transformers mapping)

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "../../../../../../shared/fixtures")


def q_weight(layer, rows, cols):
    """Uniform in +-1/sqrt(cols) from a multiplicative hash of the flat index (f64 math, then f32)."""
    i = np.arange(rows * cols, dtype=np.uint64) + np.uint64(layer * rows * cols)
    u = ((i * np.uint64(2654435761)) % np.uint64(4294967296)).astype(np.float64) / 4294967296.0
    return ((u - 0.5) * (2.0 / math.sqrt(cols))).astype(np.float32).reshape(rows, cols)


def build(cfg, sd):
    config = DeepseekV2Config(**cfg)
    config._attn_implementation = "eager"
    model = DeepseekV2ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    return model


@torch.no_grad()
def logits(model, ids):
    return model(torch.tensor([ids])).logits[0].float()


def main():
    fdir = os.path.join(ROOT, "deepseek_v2")
    ref = json.load(open(os.path.join(fdir, "ref.json")))
    cfg = json.load(open(os.path.join(fdir, "config.json")))
    for k in ("architectures", "model_type", "id2label", "label2id"):
        cfg.pop(k, None)
    sd = state_dict(os.path.join(fdir, "model-f32.gguf"), cfg)
    ids = ref["prompt"]["ids"]
    gap = (logits(build(cfg, sd), ids) - torch.tensor(ref["hf"]["logits"])).abs().max().item()
    print(f"rebuilt model vs fixture hf.logits: max_abs {gap:.2e}")
    assert gap < 1e-4, "weight mapping is wrong"

    rows = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    for i in range(cfg["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        for k in ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"):
            del sd[a + k]
        sd[a + "q_proj.weight"] = torch.from_numpy(q_weight(i, rows, cfg["hidden_size"]))
    cfg["q_lora_rank"] = None
    model = build(cfg, sd)
    out_logits = logits(model, ids)
    seq, greedy = list(ids), []
    for _ in range(16):
        nxt = int(torch.argmax(logits(model, seq)[-1]).item())
        greedy.append(nxt)
        seq.append(nxt)
    out = {
        "source": "transformers DeepseekV2ForCausalLM, float32, eager attention, weights of shared/fixtures/deepseek_v2/model-f32.gguf with q_proj from q_weight()",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "q_weight": "w[layer][r][c] = f32((u - 0.5) * 2 / sqrt(n_embd)), u = ((layer*rows*cols + r*cols + c) * 2654435761 mod 2^32) / 2^32",
        "prompt_ids": ids,
        "logits": [[float(f"{x:.6g}") for x in row] for row in out_logits.tolist()],
        "greedy": greedy,
    }
    with open(os.path.join(HERE, "ref.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote ref.json", greedy)


if __name__ == "__main__":
    main()
