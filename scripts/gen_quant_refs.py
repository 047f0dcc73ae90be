#!/usr/bin/env python3
"""Reference data for compute::quant's tests (crates/compute/tests/quant_*.rs).

Writes, under crates/compute/testdata/quant/:

  refs.gguf            small tensors, three kinds (names below; shapes ne0 first as GGUF stores):
      fx.<TYPE>.q      a few rows of a real tensor of <TYPE> from a fixture file (bytes written by
                       llama-quantize from model-f32.gguf, or by the HF converter for F16)
      fx.<TYPE>.src    the same rows from the fixture's model-f32.gguf (the quantizer's input)
      fx.<TYPE>.deq    gguf-py's numpy dequantization of fx.<TYPE>.q (float32)
      syn.<TYPE>.q     random but valid blocks (random quants, f16 scales of a sane size, plus
                       edge cases: zero scales, subnormal/huge MXFP4 exponents, f16/bf16 specials)
      syn.<TYPE>.deq   numpy dequantization of syn.<TYPE>.q (gguf-py, or the two-line formula for
                       Q8_K, which gguf-py lacks)
      gp.<TYPE>.src    random rows (normal, with edge-case blocks: all zero, constant, ties)
      gp.<TYPE>.q      gguf-py's quantize of gp.<TYPE>.src (types gguf-py can quantize)
    Metadata `quant_refs.source.<tensor>` says where each fx tensor came from.

  fixture_digests.tsv  for several fixture GGUFs: per tensor, the sha256 of gguf-py's float32
                       dequantization (little-endian bytes). The tests dequantize the same tensors
                       and compare digests when ../shared/fixtures is present.

Usage: pip install gguf numpy; python3 scripts/gen_quant_refs.py [--fixtures /work/shared/fixtures]
Deterministic (fixed seeds); gguf 0.19.0, numpy 2.x were used for the committed files.
"""

import argparse
import hashlib
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "crates", "compute", "testdata", "quant")

# One real tensor per type found in the fixtures: (arch, variant file, tensor name, row indices).
FIXTURE_PICKS = {
    "F16": ("llama", "f16", "output.weight", [0, 1, 255, 511]),
    "Q8_0": ("llama", "q8_0", "output.weight", [0, 7, 300, 511]),
    "Q4_0": ("llama", "q4_0", "token_embd.weight", [0, 3, 200, 511]),
    "Q4_1": ("llama", "q4_1", "token_embd.weight", [1, 2, 400, 510]),
    "Q5_0": ("qwen3_moe", "q4_k_m", "token_embd.weight", [0, 5, 100, 250, 300, 511]),
    "Q5_1": ("qwen3_moe", "q5_k_m", "token_embd.weight", [0, 9, 111, 222, 333, 511]),
    "Q4_K": ("qwen3_moe", "q4_k_m", "blk.0.ffn_down_exps.weight", [0, 127, 500, 1023]),
    "Q5_K": ("qwen3_moe", "q4_k_m", "blk.0.attn_output.weight", [0, 31, 64, 127]),
    "Q6_K": ("llama", "q4_0", "output.weight", [0, 1, 256, 511]),
}

# Files whose every tensor gets a digest of its numpy dequantization.
DIGEST_ARCHS = ["llama", "qwen3_moe", "gemma3"]
DIGEST_VARIANTS = ["f16", "q8_0", "q4_0", "q4_1", "q4_k_m", "q5_k_m", "q6_k"]

# Types gguf-py can quantize (bytes compared exactly).
GGUF_PY_QUANTIZE = ["BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]


def rows_of(reader_tensor, rows):
    """The given rows of a tensor as raw bytes (quantized) or values, flattened to 2-D."""
    data = np.asarray(reader_tensor.data)
    n_rows = int(np.prod(reader_tensor.shape[1:])) if len(reader_tensor.shape) > 1 else 1
    data = data.reshape((n_rows, -1))
    return data[rows]


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def synthetic_blocks(name, n_blocks, rng):
    """Random but valid blocks of a type, as an (n_blocks, block_bytes) uint8 array."""
    qtype = T[name]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    scale = (0.002 + 0.03 * rng.random(n_blocks)) * np.where(rng.random(n_blocks) < 0.5, -1, 1)
    if name == "Q2_K":  # scales[16] qs[64] d dmin
        b[:, 80:82] = f16_bytes(np.abs(scale))
        b[:, 82:84] = f16_bytes(np.abs(scale) * 0.5)
        b[0, 80:84] = 0  # zero d and dmin
    elif name == "Q3_K":  # hmask[32] qs[64] scales[12] d
        b[:, 108:110] = f16_bytes(scale * 0.1)
        b[0, 108:110] = 0
    elif name in ("IQ4_NL",):  # d qs[16]
        b[:, 0:2] = f16_bytes(scale * 0.1)
        b[0, 0:2] = 0
    elif name == "IQ4_XS":  # d scales_h scales_l[4] qs[128]
        b[:, 0:2] = f16_bytes(scale * 0.05)
        b[0, 0:2] = 0
    elif name == "MXFP4":  # e qs[16]
        b[:, 0] = rng.integers(100, 140, size=n_blocks)
        edge = [0, 1, 2, 127, 128, 254, 255]
        b[: len(edge), 0] = edge
    elif name == "Q8_K":  # f32 d, i8 qs[256], i16 bsums[16]
        b[:, 0:4] = np.asarray(scale * 0.01, dtype=np.float32).view(np.uint8).reshape(-1, 4)
        b[0, 0:4] = 0
    else:
        raise ValueError(name)
    return b


def synthetic_plain(name, n_values, rng):
    """F16 / BF16 / F32 values with specials (±0, ±inf, NaN, subnormals) as raw bytes."""
    if name == "F16":
        v = rng.standard_normal(n_values).astype(np.float16).view(np.uint16)
        specials = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x0001, 0x83FF, 0x7BFF, 0x0400]
        v[: len(specials)] = specials
        return v.view(np.uint8)
    if name == "BF16":
        v = (rng.standard_normal(n_values).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        specials = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x0001, 0x807F, 0x7F7F, 0x0080]
        v[: len(specials)] = specials
        return v.view(np.uint8)
    if name == "F32":
        v = rng.standard_normal(n_values).astype(np.float32).view(np.uint32)
        specials = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001]
        v[: len(specials)] = specials
        return v.view(np.uint8)
    raise ValueError(name)


def numpy_dequant(name, raw):
    if name == "Q8_K":  # gguf-py has no Q8_K class: y = d * q in float32
        d = raw[:, 0:4].copy().view(np.float32)
        q = raw[:, 4:260].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    return dequantize(raw, T[name]).astype(np.float32).reshape(-1)


def quantize_input(n_rows, k, rng):
    """Rows of weight-like values with edge-case blocks that exercise ties and zero scales."""
    x = (rng.standard_normal((n_rows, k)) * 0.05).astype(np.float32)
    x[0, 0:32] = 0.0  # all-zero block
    x[0, 32:64] = 0.25  # constant block
    x[0, 64:96] = np.where(np.arange(32) % 2 == 0, 1.0, -1.0)  # |max| ties, sign changes
    x[1, 0:32] *= 1000.0  # large magnitudes
    x[1, 32:64] *= 1e-6  # tiny magnitudes
    return x


def add(writer, name, array, raw_dtype=None):
    writer.add_tensor(name, array, raw_dtype=raw_dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(HERE, "..", "..", "shared", "fixtures"))
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261130)

    w = gguf.GGUFWriter(os.path.join(OUT, "refs.gguf"), "quant_refs")
    w.add_string("quant_refs.generator", "scripts/gen_quant_refs.py, gguf-py " + gguf.__name__ + " "
                 + getattr(gguf, "__version__", "0.19.0") + ", numpy " + np.__version__)

    readers = {}

    def reader(arch, variant):
        key = (arch, variant)
        if key not in readers:
            readers[key] = gguf.GGUFReader(os.path.join(args.fixtures, arch, f"model-{variant}.gguf"))
        return readers[key]

    # 1. Real tensors from the fixtures.
    for name, (arch, variant, tname, rows) in FIXTURE_PICKS.items():
        t = next(t for t in reader(arch, variant).tensors if t.name == tname)
        assert t.tensor_type.name == name, (name, t.tensor_type.name)
        raw = np.ascontiguousarray(rows_of(t, rows))
        src_t = next(t for t in reader(arch, "f32").tensors if t.name == tname)
        src = np.ascontiguousarray(rows_of(src_t, rows)).astype(np.float32)
        deq = numpy_dequant(name, raw).reshape(src.shape)
        add(w, f"fx.{name}.q", raw, raw_dtype=T[name])
        add(w, f"fx.{name}.src", src)
        add(w, f"fx.{name}.deq", deq)
        w.add_string(f"quant_refs.source.fx.{name}",
                     f"{arch}/model-{variant}.gguf {tname} rows {rows}; src from {arch}/model-f32.gguf")
        print(f"fx.{name}: {raw.shape[0]} rows of {src.shape[1]} from {arch}/model-{variant}.gguf {tname}")

    # 2. Random valid blocks of every type, including the ones no fixture has.
    for name in ["F32", "F16", "BF16", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "Q8_K"]:
        if name in ("F32", "F16", "BF16"):
            k = 256
            raw = synthetic_plain(name, 4 * k, rng).reshape(4, -1)
            deq = dequantize(raw, T[name]).astype(np.float32).reshape(4, k)
        else:
            block_elems = gguf.GGML_QUANT_SIZES[T[name]][0]
            n_blocks = 24 if block_elems == 32 else 6
            blocks = synthetic_blocks(name, n_blocks, rng)
            deq = numpy_dequant(name, blocks)
            k = block_elems * (2 if block_elems == 256 else 8)
            raw = blocks.reshape(-1, (k // block_elems) * blocks.shape[1])
            deq = deq.reshape(-1, k)
        add(w, f"syn.{name}.q", raw, raw_dtype=T[name])
        add(w, f"syn.{name}.deq", deq)
        print(f"syn.{name}: {raw.shape[0]} rows of {k}")

    # 3. gguf-py's quantizers on random rows.
    for name in GGUF_PY_QUANTIZE:
        k = 256
        x = quantize_input(4, k, rng)
        q = quantize(x, T[name])
        add(w, f"gp.{name}.src", x)
        add(w, f"gp.{name}.q", q, raw_dtype=T[name])
        print(f"gp.{name}: {x.shape[0]} rows of {k}")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # 4. Digests of whole fixture files.
    lines = ["# file\ttensor\ttype\tn_values\tsha256 of gguf-py float32 dequantization (LE)"]
    for arch in DIGEST_ARCHS:
        for variant in DIGEST_VARIANTS:
            for t in reader(arch, variant).tensors:
                deq = np.ascontiguousarray(dequantize(t.data, t.tensor_type).astype("<f4"))
                digest = hashlib.sha256(deq.tobytes()).hexdigest()
                lines.append(f"{arch}/model-{variant}.gguf\t{t.name}\t{t.tensor_type.name}\t{deq.size}\t{digest}")
    with open(os.path.join(OUT, "fixture_digests.tsv"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"fixture_digests.tsv: {len(lines) - 1} tensors")


if __name__ == "__main__":
    sys.exit(main())
