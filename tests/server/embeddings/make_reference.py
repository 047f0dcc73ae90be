#!/usr/bin/env python3
"""Reference embeddings for /v1/embeddings, from llama.cpp (the peer, 0c1e570), not from diskformer.

For the qwen3 fixture (f32 and q4_0) and each pooling type llama.cpp knows for sequence
embeddings (1 mean, 2 cls, 3 last), writes a copy of the GGUF with `qwen3.pooling_type` added
(llama.cpp's convention: Qwen3-Embedding is the qwen3 architecture with pooling `last`) using the
peer's own gguf-py, asks the peer's `llama-server --embeddings` for the embeddings of INPUTS
(its /v1/embeddings: the pooling read from the file, L2 normalization, the same code path as
`llama-embedding`, whose JSON output on stdout is often cut short at exit by llama.cpp's
asynchronous logger when written to a pipe or file), and stores the vectors in reference.json
next to this script.

Usage: make_reference.py [PEER_BIN]
  PEER_BIN: folder with llama-server (default ~/.cache/diskformer-peer/build-cpu/bin, built by
  ../shared/tools/build-llama-cpp.sh); run with a Python that has numpy and pyyaml (python3 -m venv
  V && V/bin/pip install numpy pyyaml). The gguf-py used is the one vendored in the peer's source.
"""
import json, os, socket, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path

here = Path(__file__).resolve().parent
repo = here.parent.parent.parent
peer = Path(os.environ.get("DISKFORMER_PEER", Path.home() / ".cache/diskformer-peer"))
sys.path.insert(0, str(peer / "llama.cpp-0c1e570/gguf-py"))
import gguf  # noqa: E402

peer_bin = Path(sys.argv[1]) if len(sys.argv) > 1 else peer / "build-cpu/bin"
fixtures = repo / "../shared/fixtures/qwen3"
if not fixtures.exists():
    fixtures = repo / "tests/fixtures/qwen3"
INPUTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a"]
POOLINGS = {1: "mean", 2: "cls", 3: "last"}


def with_pooling(src: Path, dst: Path, pooling_type: int) -> None:
    """A copy of `src` with `qwen3.pooling_type` added (gguf_new_metadata.py's copy, inlined)."""
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    writer.add_key_value(f"{arch}.pooling_type", pooling_type, gguf.GGUFValueType.UINT32)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def peer_embeddings(model: Path) -> list:
    """The peer's /v1/embeddings on `model` (llama-server --embeddings, default L2 normalization)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([str(peer_bin / "llama-server"), "-m", str(model), "--embeddings", "-t", "1", "-c", "256",
                             "-np", "1", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                sys.exit(f"llama-server exited on {model}")
            time.sleep(0.1)
        req = urllib.request.Request(f"{url}/v1/embeddings", json.dumps({"input": INPUTS, "model": "m"}).encode(),
                                     {"Content-Type": "application/json"})
        data = json.load(urllib.request.urlopen(req, timeout=120))["data"]
        return sorted(data, key=lambda d: d["index"])
    finally:
        proc.kill()
        proc.wait()


cases = []
with tempfile.TemporaryDirectory() as tmp:
    for file in ["model-f32.gguf", "model-q4_0.gguf"]:
        for pooling_type, name in POOLINGS.items():
            dst = Path(tmp) / f"{name}-{file}"
            with_pooling(fixtures / file, dst, pooling_type)
            data = peer_embeddings(dst)
            cases.append({"file": file, "pooling_type": pooling_type, "pooling": name,
                          "embeddings": [[round(x, 7) for x in d["embedding"]] for d in data]})
            print(f"{file} {name}: {len(data)} x {len(data[0]['embedding'])}", file=sys.stderr)

json.dump({"peer": "llama.cpp 0c1e570 llama-server --embeddings -t 1 -c 256 -np 1, /v1/embeddings",
           "fixture": "qwen3 (shared/fixtures/qwen3, identical to tests/fixtures/qwen3)",
           "key_added": "qwen3.pooling_type (u32)", "inputs": INPUTS, "cases": cases},
          open(here / "reference.json", "w"), indent=None, separators=(",", ":"))
print(f"wrote {here / 'reference.json'}", file=sys.stderr)
