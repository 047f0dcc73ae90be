#!/usr/bin/env python3
"""Copies the compact fixture subset that a fresh clone's tests run (tests/fixtures/).

From ../shared/fixtures (see its README for how the references were made): for every
architecture, model-q4_0.gguf with its llama.cpp dequant_f32 references; for qwen3 and llama also
model-f32.gguf with transformers' logits at every position. ref.json keeps only the fields the
tests read. Run from the repository root: python3 scripts/make-fixture-subset.py
"""
import json, os, shutil, sys

SRC = sys.argv[1] if len(sys.argv) > 1 else "../shared/fixtures"
DST = "tests/fixtures"
F32_ARCHS = {"qwen3"}

def trim(ref, variants):
    out = {k: ref[k] for k in ("format_version", "arch", "gguf_arch", "prompt", "n_vocab", "n_gen")}
    out["provenance"] = "trimmed copy of shared/fixtures/%s/ref.json by scripts/make-fixture-subset.py" % ref["arch"]
    out["hf"] = {"greedy": ref["hf"]["greedy"]}
    if "f32" in variants:
        out["hf"]["logits"] = ref["hf"]["logits"]
    out["llama_cpp"] = {}
    for v in variants:
        src = ref["llama_cpp"][v]
        keep = {"file": src["file"], "vs_hf": src["vs_hf"]}
        if "dequant_f32" in src:
            d = src["dequant_f32"]
            keep["dequant_f32"] = {"last_logits": d["last_logits"], "greedy": d["greedy"]}
        out["llama_cpp"][v] = keep
    # The f32 gap of llama.cpp itself (refcheck widens bounds where the peer departs from HF).
    out["llama_cpp"].setdefault("f32", {"vs_hf": ref["llama_cpp"]["f32"]["vs_hf"]})
    return out

shutil.rmtree(DST, ignore_errors=True)
total = 0
for arch in sorted(os.listdir(SRC)):
    ref_path = os.path.join(SRC, arch, "ref.json")
    if not os.path.exists(ref_path):
        continue
    ref = json.load(open(ref_path))
    variants = ["q4_0"] + (["f32"] if arch in F32_ARCHS else [])
    os.makedirs(os.path.join(DST, arch))
    for v in variants:
        f = ref["llama_cpp"][v]["file"]
        shutil.copy(os.path.join(SRC, arch, f), os.path.join(DST, arch, f))
        total += os.path.getsize(os.path.join(DST, arch, f))
    t = trim(ref, variants)
    if "f32" not in variants:
        t["llama_cpp"]["f32"] = {"vs_hf": ref["llama_cpp"]["f32"]["vs_hf"]}
    with open(os.path.join(DST, arch, "ref.json"), "w") as fh:
        json.dump(t, fh, allow_nan=True)
    total += os.path.getsize(os.path.join(DST, arch, "ref.json"))
with open(os.path.join(DST, "README.md"), "w") as fh:
    fh.write("# Compact fixture subset\n\nA trimmed copy of `../shared/fixtures` (its README explains how every\n"
             "reference was made: tiny random models of 14 architectures, transformers f32 logits, llama.cpp\n"
             "0c1e570 logits on the GGUF dequantized by gguf-py). Made by `scripts/make-fixture-subset.py`.\n"
             "Tests use it only when `../shared/fixtures` is absent, and say so.\n")
print("subset: %.1f MB" % (total / 1e6))
