#!/usr/bin/env python3
"""Builds the BERT fixture: a tiny randomly initialised `transformers` BertModel with a WordPiece
tokenizer trained here, converted to GGUF by llama.cpp's own converter, and reference outputs from
two independent implementations: PyTorch `transformers` (float32) and llama.cpp.

Nothing comes from a model hub. The WordPiece trainer breaks ties between equally frequent pairs
in no fixed order, so a rerun can give a slightly different vocabulary (and model file): the
committed files are one run, consistent with each other. Outputs (committed beside this script):
  model-f32.gguf   the converted model (sentence-transformers mean pooling, so `bert.pooling_type` = 1)
  ref.json         per case: text, HF token ids, llama.cpp token ids (llama-tokenize), the last hidden
                   state of every token (transformers), the mean-pooled L2-normalised embedding
                   (transformers, and llama.cpp's llama-server /embedding when a server binary is given)

Usage (from this directory):
  LLAMA_CPP_DIR=~/.cache/diskformer-peer/llama.cpp-0c1e570 \
  LLAMA_BIN=~/.cache/diskformer-peer/build-cpu/bin python3 make.py
Versions used for the committed files: see README.md.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import BertConfig, BertModel, BertTokenizerFast

HERE = Path(__file__).resolve().parent
LLAMA_CPP_DIR = Path(os.path.expanduser(os.environ["LLAMA_CPP_DIR"]))
LLAMA_BIN = Path(os.path.expanduser(os.environ.get("LLAMA_BIN", "")))
DRIVER = HERE.parents[4] / ".." / "shared" / "fixtures" / "make" / "convert_driver.py"

# Training text: plain sentences plus accents, CJK, punctuation and digits, so that the trained
# vocabulary has word pieces ("##...") and the cases below exercise every branch of WordPiece.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to vectors; similar sentences get similar vectors.",
    "A model larger than your GPU memory runs at a speed you can use.",
    "Weights stay on disk in GGUF files, and the GPU holds a cache of experts.",
    "Naïve café owners résumé their piñata collections, déjà vu!",
    "東京は日本の首都です。北京是中国的首都。",
    "Numbers like 3.14159, 2026 and 1,000,000 are tokenized digit by digit or in pieces.",
    "Don't stop: it's 5 o'clock somewhere -- (really) [maybe] {surely} <never>.",
    "Running, runner, runs and ran share the stem run; unbelievable is un-believ-able.",
    "Transformers use attention: every token looks at every other token in an encoder.",
] * 20

CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "NAÏVE Café RÉSUMÉ",
    "unbelievable runners don't stop",
    "東京は首都",
    "3.14159 and 1,000,000!",
    "  leading and   multiple   spaces\tand\ttabs\nand newlines  ",
    "zyzzyva qwxj",  # letters the vocabulary has only as single characters
    "Embeddings map sentences to vectors.",
]


def train_tokenizer(out_dir: Path) -> BertTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials, min_frequency=2)
    tok.train_from_iterator(CORPUS, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    fast = BertTokenizerFast(tokenizer_object=tok, do_lower_case=True, strip_accents=True)
    fast.save_pretrained(out_dir)
    return fast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_cpp_embeddings(gguf: Path, texts: list[str]) -> list[list[float]] | None:
    server = LLAMA_BIN / "llama-server"
    if not server.exists():
        print("no llama-server: llama.cpp embeddings skipped", file=sys.stderr)
        return None
    port = free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA_BIN))
    proc = subprocess.Popen(
        # Flash attention off: its CPU kernel rounds K and V to f16, which a random model with sharp
        # attention turns into differences of 1e-4 in the embedding.
        [str(server), "-m", str(gguf), "--embeddings", "--port", str(port), "-t", "2", "-c", "128", "-b", "128", "-ub", "128", "-fa", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:
                time.sleep(0.1)
        out = []
        for t in texts:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/embeddings",
                data=json.dumps({"input": t, "model": "x"}).encode(),
                headers={"Content-Type": "application/json"},
            )
            out.append(json.load(urllib.request.urlopen(req))["data"][0]["embedding"])
        return out
    finally:
        proc.terminate()
        proc.wait()


def llama_cpp_ids(gguf: Path, text: str) -> list[int]:
    exe = LLAMA_BIN / "llama-tokenize"
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA_BIN))
    r = subprocess.run(
        [str(exe), "-m", str(gguf), "-p", text, "--ids", "--log-disable"],
        capture_output=True, text=True, env=env, check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp())
    hf = work / "hf"
    fast = train_tokenizer(hf)
    cfg = BertConfig(
        vocab_size=len(fast), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu",
        layer_norm_eps=1e-12,
    )
    model = BertModel(cfg, add_pooling_layer=False).eval()
    # Random init gives LayerNorm weight 1 and bias 0 and zero linear biases: perturb them so a
    # missing bias or norm weight shows in the outputs.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(hf)
    (hf / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (hf / "1_Pooling").mkdir()
    (hf / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))

    gguf = HERE / "model-f32.gguf"
    env = dict(os.environ, LLAMA_CPP_DIR=str(LLAMA_CPP_DIR), REF_TOKPRE="default")
    subprocess.run(
        [sys.executable, str(DRIVER.resolve()), str(hf), "--outtype", "f32", "--outfile", str(gguf)],
        check=True, env=env, stdout=subprocess.DEVNULL,
    )

    cases = []
    for text in CASES:
        ids = fast(text)["input_ids"]
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        pooled = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        cases.append({
            "text": text,
            "hf_ids": ids,
            "llama_cpp_ids": llama_cpp_ids(gguf, text),
            "hidden": [[round(float(x), 7) for x in row] for row in hidden],
            "embedding": [round(float(x), 7) for x in pooled],
        })
    emb = llama_cpp_embeddings(gguf, CASES)
    for c, e in zip(cases, emb or [None] * len(cases)):
        c["llama_cpp_embedding"] = e
    (HERE / "ref.json").write_text(json.dumps({
        "n_embd": 64, "pooling": "mean", "cases": cases,
    }, indent=None, separators=(",", ":")))
    shutil.rmtree(work)
    for c in cases:
        same = c["hf_ids"] == c["llama_cpp_ids"]
        print(f"{c['text']!r}: {len(c['hf_ids'])} ids, hf == llama.cpp: {same}")


if __name__ == "__main__":
    main()
