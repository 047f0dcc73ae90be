#!/usr/bin/env python3
"""Builds the nomic-bert fixture: a tiny GGUF of llama.cpp's `nomic-bert` architecture (the
layout nomic-embed-text converts to: fused qkv without bias, NeoX rope instead of position
embeddings, SwiGLU FFN, post-norm layers) with random weights from a fixed seed, written by
gguf-py, and the embeddings llama.cpp's llama-server gives for it (the reference: transformers has
no NomicBert class; its modelling code lives on the model hub, which we do not use).

The vocabulary and tokenizer keys are copied from the bert fixture (../bert/model-f32.gguf).
Outputs: model-f32.gguf, ref.json (per case: text, llama.cpp token ids, mean-pooled L2-normalised
embedding).

Usage (from this directory):
  LLAMA_CPP_DIR=~/.cache/diskformer-peer/llama.cpp-0c1e570 \
  LLAMA_BIN=~/.cache/diskformer-peer/build-cpu/bin python3 make.py
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType, PoolingType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bert"))
import make as bert_make  # noqa: E402  (the bert fixture's cases and llama.cpp helpers)

N_EMBD, N_HEAD, N_FF, N_LAYER, N_CTX = 64, 4, 96, 2, 128


def main() -> None:
    src = GGUFReader(str(HERE.parent / "bert" / "model-f32.gguf"))
    w = GGUFWriter(str(HERE / "model-f32.gguf"), "nomic-bert")
    w.add_block_count(N_LAYER)
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(PoolingType.MEAN)
    w.add_rope_freq_base(1000.0)
    w.add_token_type_count(2)
    w.add_file_type(0)
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                vals = [bytes(field.parts[i]).decode() for i in field.data]
            else:
                vals = [field.parts[i].tolist()[0] for i in field.data]
            w.add_array(key, vals)
        elif vtype == GGUFValueType.STRING:
            w.add_string(key, bytes(field.parts[field.data[0]]).decode())
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)

    rng = np.random.default_rng(0)
    def t(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    def norm_w():
        return (1.0 + rng.standard_normal(N_EMBD) * 0.1).astype(np.float32)
    # numpy shapes are ggml's reversed: (rows, columns) = (ne1, ne0).
    w.add_tensor("token_embd.weight", t(n_vocab, N_EMBD, scale=0.5))
    w.add_tensor("token_types.weight", t(2, N_EMBD, scale=0.5))
    w.add_tensor("token_embd_norm.weight", norm_w())
    w.add_tensor("token_embd_norm.bias", t(N_EMBD, scale=0.1))
    for il in range(N_LAYER):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_qkv.weight", t(3 * N_EMBD, N_EMBD))
        w.add_tensor(p + "attn_output.weight", t(N_EMBD, N_EMBD))
        w.add_tensor(p + "attn_output_norm.weight", norm_w())
        w.add_tensor(p + "attn_output_norm.bias", t(N_EMBD, scale=0.1))
        w.add_tensor(p + "ffn_up.weight", t(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_gate.weight", t(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_down.weight", t(N_EMBD, N_FF))
        w.add_tensor(p + "layer_output_norm.weight", norm_w())
        w.add_tensor(p + "layer_output_norm.bias", t(N_EMBD, scale=0.1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    gguf = HERE / "model-f32.gguf"
    # Long enough cases that rope matters: the bert cases plus one of 40+ tokens.
    cases = bert_make.CASES + ["the quick brown fox jumps over the lazy dog " * 5]
    emb = bert_make.llama_cpp_embeddings(gguf, cases)
    if emb is None:
        sys.exit("llama-server is needed for the reference")
    out = [{"text": c, "llama_cpp_ids": bert_make.llama_cpp_ids(gguf, c), "llama_cpp_embedding": [round(x, 7) for x in e]}
           for c, e in zip(cases, emb)]
    (HERE / "ref.json").write_text(json.dumps({"n_embd": N_EMBD, "pooling": "mean", "cases": out}, separators=(",", ":")))
    for c in out:
        print(f"{c['text'][:40]!r}: {len(c['llama_cpp_ids'])} ids")


if __name__ == "__main__":
    main()
