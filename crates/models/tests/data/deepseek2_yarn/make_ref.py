#!/usr/bin/env python3
"""Reference logits for DeepSeek-V3 under YaRN rope scaling, from transformers.

The shared fixtures have no rope scaling, so this builds one case: the `deepseek_v3` fixture's
weights (read back from its f32 GGUF, inverting the converter's renames and its kv_b split) in
transformers' DeepseekV3ForCausalLM with `rope_parameters` set to YaRN (factor 4 over an original
context of 64, mscale = mscale_all_dim = 0.707 as in DeepSeek-V2-Lite, beta 32/1). It first checks
that the rebuilt model without scaling reproduces the fixture's own `hf.logits` (so the weight
mapping is right), then writes ref.json: the prompt, logits at every prompt position, and 16
greedy ids (argmax, full recompute each step), under the scaling. The Rust test
(`deepseek2::tests::yarn_matches_transformers`) adds the matching GGUF keys to the fixture file,
as llama.cpp's converter writes them: rope.scaling.type yarn, rope.scaling.factor,
rope.scaling.original_context_length, rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim.

Usage: python3 make_ref.py [FIXTURES_ROOT]   (default ../../../../../../shared/fixtures)
Needs: torch (CPU), transformers 5.24, gguf, numpy.
"""
import json
import os
import sys

import gguf
import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "../../../../../../shared/fixtures")
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def state_dict(path, cfg):
    t = {x.name: torch.from_numpy(np.array(x.data, dtype=np.float32)) for x in gguf.GGUFReader(path).tensors}
    sd = {
        "model.embed_tokens.weight": t["token_embd.weight"],
        "lm_head.weight": t["output.weight"],
        "model.norm.weight": t["output_norm.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        a, m = q + "self_attn.", q + "mlp."
        sd[q + "input_layernorm.weight"] = t[p + "attn_norm.weight"]
        sd[q + "post_attention_layernorm.weight"] = t[p + "ffn_norm.weight"]
        if p + "attn_q_a.weight" in t:
            sd[a + "q_a_proj.weight"] = t[p + "attn_q_a.weight"]
            sd[a + "q_a_layernorm.weight"] = t[p + "attn_q_a_norm.weight"]
            sd[a + "q_b_proj.weight"] = t[p + "attn_q_b.weight"]
        sd[a + "kv_a_proj_with_mqa.weight"] = t[p + "attn_kv_a_mqa.weight"]
        sd[a + "kv_a_layernorm.weight"] = t[p + "attn_kv_a_norm.weight"]
        k_b = t[p + "attn_k_b.weight"]  # [n_head, kv_lora, nope] (the converter transposed it)
        v_b = t[p + "attn_v_b.weight"]  # [n_head, v, kv_lora]
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [n_head, nope + v, kv_lora]
        sd[a + "kv_b_proj.weight"] = kv_b.reshape(-1, cfg["kv_lora_rank"])
        sd[a + "o_proj.weight"] = t[p + "attn_output.weight"]
        if p + "ffn_gate_inp.weight" in t:
            sd[m + "gate.weight"] = t[p + "ffn_gate_inp.weight"]
            if p + "exp_probs_b.bias" in t:
                sd[m + "gate.e_score_correction_bias"] = t[p + "exp_probs_b.bias"]
            sd[m + "experts.gate_up_proj"] = torch.cat([t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"]], dim=1)
            sd[m + "experts.down_proj"] = t[p + "ffn_down_exps.weight"]
            for w in ("gate", "up", "down"):
                sd[m + f"shared_experts.{w}_proj.weight"] = t[p + f"ffn_{w}_shexp.weight"]
        else:
            for w in ("gate", "up", "down"):
                sd[m + f"{w}_proj.weight"] = t[p + f"ffn_{w}.weight"]
    return sd


def build(cfg, sd):
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    return model


@torch.no_grad()
def logits(model, ids):
    return model(torch.tensor([ids])).logits[0].float()


def main():
    fdir = os.path.join(ROOT, "deepseek_v3")
    ref = json.load(open(os.path.join(fdir, "ref.json")))
    cfg = json.load(open(os.path.join(fdir, "config.json")))
    for k in ("architectures", "model_type", "id2label", "label2id"):
        cfg.pop(k, None)
    sd = state_dict(os.path.join(fdir, "model-f32.gguf"), cfg)
    ids = ref["prompt"]["ids"]

    plain = logits(build(cfg, sd), ids)
    want = torch.tensor(ref["hf"]["logits"])
    gap = (plain - want).abs().max().item()
    print(f"rebuilt model vs fixture hf.logits: max_abs {gap:.2e}")
    assert gap < 1e-4, "weight mapping is wrong"

    cfg["rope_parameters"] = dict(YARN)
    cfg["max_position_embeddings"] = int(YARN["factor"] * YARN["original_max_position_embeddings"])
    model = build(cfg, sd)
    scaled = logits(model, ids)
    print(f"yarn vs plain: max_abs {(scaled - plain).abs().max().item():.2e}")
    seq, greedy = list(ids), []
    for _ in range(16):
        nxt = int(torch.argmax(logits(model, seq)[-1]).item())
        greedy.append(nxt)
        seq.append(nxt)
    out = {
        "source": "transformers DeepseekV3ForCausalLM, float32, eager attention, weights of shared/fixtures/deepseek_v3/model-f32.gguf",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "rope_parameters": YARN,
        "gguf_keys": {
            "deepseek2.rope.scaling.type": "yarn",
            "deepseek2.rope.scaling.factor": YARN["factor"],
            "deepseek2.rope.scaling.original_context_length": YARN["original_max_position_embeddings"],
            "deepseek2.rope.scaling.yarn_log_multiplier": 0.1 * YARN["mscale_all_dim"],
        },
        "prompt_ids": ids,
        "logits": [[float(f"{x:.6g}") for x in row] for row in scaled.tolist()],
        "greedy": greedy,
    }
    with open(os.path.join(HERE, "ref.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote ref.json", greedy)


if __name__ == "__main__":
    main()
