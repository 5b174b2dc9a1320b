"""Writes the seed corpus of fuzz_safetensors (tests/fuzz/corpus/fuzz_safetensors/): small valid
files covering each dtype attn reads, metadata, escapes, scalars and empty tensors, and a few
near-misses that stop at different checks. Plain Python, no dependencies:
    python3 tests/fuzz/seeds_safetensors.py
"""
import json
import os
import struct

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "fuzz_safetensors")


def blob(header, data=b"", pad=True):
    text = json.dumps(header, separators=(",", ":")).encode() if isinstance(header, dict) else header
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


f32 = struct.pack("<4f", 1.0, -2.5, 3.0, 0.0)
seeds = {
    "f32_2x2": blob({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, f32),
    "metadata_two": blob({"__metadata__": {"format": "pt", "k\n": "v\u00e9"},
                          "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                          "b.bias": {"dtype": "F32", "shape": [3], "data_offsets": [4, 16]}}, f32),
    "f64_f16_bf16": blob({"d": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]},
                          "h": {"dtype": "F16", "shape": [2], "data_offsets": [8, 12]},
                          "b": {"dtype": "BF16", "shape": [], "data_offsets": [12, 14]}},
                         struct.pack("<d2HH", 0.5, 0x3C00, 0x7E00, 0x4049)),
    "empty_and_scalar": blob({"e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
                              "s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, f32[:4]),
    "escapes": blob(b'{"\\u00e9\\ud83d\\ude00\\"\\\\":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', f32[:4]),
    "empty_header": blob({}),
    "bad_i64": blob({"i": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
    "bad_gap": blob({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32[:8]),
    "bad_len": struct.pack("<Q", 1 << 40) + b"{}",
}
os.makedirs(out, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)
print(f"wrote {len(seeds)} seeds to {out}")
