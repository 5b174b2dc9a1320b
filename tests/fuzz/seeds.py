#!/usr/bin/env python3
"""Writes the seed corpora under tests/fuzz/corpus/<target>/ (committed; rerun after changing a
target's byte layout). Each seed is small and covers one feature, so libFuzzer starts from
inputs that already reach every option; it mutates copies (scripts/fuzz.sh), never these."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- fuzz_fixture_parser: fixture-file snippets ---------------------------------------------------
HEADER = "# attn-fixtures v1 seed corpus\n"
write("fuzz_fixture_parser", "tensors", HEADER +
      "scalar\t\t2.5\n"
      "vec\t3\t1.0 -2.5e-3 0.1\n"
      "mat\t2,3\t0 1 2 3 4 5\n"
      "# a comment\n\n"
      "empty\t0,4\t\n"
      "rank4\t1,1,2,1\tnan -inf\n")
write("fuzz_fixture_parser", "text", HEADER +
      "@text printed\ntensor([[1.0000, 0.0000],\n        [0.5517, 0.4483]])\n@end\n"
      "@text empty\n@end\n")
write("fuzz_fixture_parser", "mixed", HEADER +
      "x\t2\t0x1p-3 1e-320\n@text x\nsame name, other kind\n\n@end\ny/f64\t1\t3.141592653589793\n")
write("fuzz_fixture_parser", "bad_count", HEADER + "x\t2,2\t1 2 3\n")
write("fuzz_fixture_parser", "bad_shape", HEADER + "x\t2,a\t1 2\n")
write("fuzz_fixture_parser", "unclosed_text", HEADER + "@text t\nno end\n")

# ---- fuzz_tensor_views: start tensor, then (op, args...) ------------------------------------------
# Start: rank (% 5), extents (% 5 each). Ops (% 11): 0 view(r, extents...), 1 transpose(d0, d1),
# 2 t, 3 select(d, i), 4 slice(d, start, end), 5 unsqueeze(d), 6 squeeze(d), 7 expand(r, [sel,
# extent]...), 8 contiguous, 9 at(sel, indices...), 10 item. Dims and indices are int8.
def b(*xs):
    return bytes(x & 0xFF for x in xs)

write("fuzz_tensor_views", "transpose_contiguous_view", b(3, 2, 3, 4, 1, 0, 2, 8, 0, 2, 0, 24))
write("fuzz_tensor_views", "select_slice", b(4, 2, 3, 4, 2, 3, 1, -1, 4, -1, 1, 3, 4, 0, -7, 7))
write("fuzz_tensor_views", "unsqueeze_expand", b(2, 3, 1, 5, 0, 7, 3, 0, 2, 0, 3, 0, 4, 6, -1))
write("fuzz_tensor_views", "view_infer", b(2, 4, 3, 0, 3, 2, 0, 4, 0, 2, 0, 1))
write("fuzz_tensor_views", "at_item_scalar", b(0, 9, 0, 10, 5, 0, 7, 2, 0, 4, 0, 2, 9, 0, 1, 1))
write("fuzz_tensor_views", "far_arguments", b(2, 2, 2, 4, 0, 240, 241, 3, 0, 245, 0, 2, 0, 248, 249))

# ---- fuzz_sdpa: see decode() in fuzz_sdpa.cpp ------------------------------------------------------
def sdpa(rank=4, B=2, Hkv=2, group=1, gqa=0, L=7, S=9, E=8, Ev=8, mask=0, flags=0, mask_rank=4,
         mask_full=0xFF, mask_layout=0, density=64, scale=0, dropout=0, torch=0, seed=1234,
         offset=7, isa=0, layouts=(0, 0, 0), value_seed=42, mags=(0, 0, 0, 0), pokes=(),
         invalid=None, invalid_arg=0, window=(0, 0), softcap=0, alibi=0, sinks=0):
    """The variants' bytes (0: off): window sides (x: kWindows[x - 1], 0: -1), softcap
    (kSoftcaps[x - 1]), alibi (bit 0 (B, H), bits 1-3 magnitude, bit 4 signs, bits 5-7 layout),
    sinks (kSinkMags[x - 1])."""
    out = bytes([7 if invalid is not None else 0, invalid or 0, invalid_arg, rank - 2, B - 1,
                 Hkv - 1, group - 1, gqa, L - 1, S - 1, E - 1, Ev - 1, mask, flags,
                 mask_rank - 1, mask_full, mask_layout, density, scale, dropout, torch])
    out += struct.pack("<QI", seed, offset) + bytes([isa]) + bytes(layouts)
    out += struct.pack("<Q", value_seed) + bytes(mags)
    out += bytes([window[0], window[1], softcap, alibi, sinks])
    for t, idx, special in pokes:
        out += bytes([t]) + struct.pack("<H", idx) + bytes([special])
    return out

W, LSE, T2, BR = 2, 4, 8, 1  # flag bits: need_weights, need_lse, two threads, bottom-right
write("fuzz_sdpa", "plain", sdpa())
write("fuzz_sdpa", "unbatched_2d", sdpa(rank=2, L=5, S=5, E=3, Ev=4, flags=W | LSE))
write("fuzz_sdpa", "heads_3d_layouts", sdpa(rank=3, Hkv=2, layouts=(1, 2, 3), flags=LSE, isa=2))
write("fuzz_sdpa", "gqa", sdpa(Hkv=2, group=3, gqa=1, L=33, S=40, E=16, Ev=5, flags=W | LSE | T2))
write("fuzz_sdpa", "causal_top_left", sdpa(mask=1, L=40, S=35, flags=LSE | W))
write("fuzz_sdpa", "causal_bottom_right", sdpa(mask=1, L=12, S=5, flags=LSE | BR, isa=1))
write("fuzz_sdpa", "bool_mask_broadcast", sdpa(mask=2, mask_rank=2, mask_full=0x0C, density=200,
                                                flags=W | LSE, layouts=(5, 6, 4)))
write("fuzz_sdpa", "additive_mask_transposed", sdpa(mask=3, mask_rank=3, mask_full=0x0E, mask_layout=1,
                                                     density=30, flags=LSE))
write("fuzz_sdpa", "custom_scales", sdpa(scale=211, E=20, Ev=3, flags=W))  # scale 1.0
write("fuzz_sdpa", "scale_zero", sdpa(scale=208, flags=W | LSE))
write("fuzz_sdpa", "philox_dropout", sdpa(dropout=177, flags=W | LSE | T2, L=20, S=30))  # p = 0.5
write("fuzz_sdpa", "dropout_one", sdpa(dropout=179, flags=W | LSE))  # p = 1
write("fuzz_sdpa", "torch_dropout", sdpa(dropout=176, torch=255, flags=W))  # p = 0.1, torch stream
write("fuzz_sdpa", "specials", sdpa(flags=W | LSE, mags=(4, 4, 3, 0),
                                     pokes=((0, 3, 0), (1, 17, 1), (2, 40, 2), (2, 5, 11), (1, 2, 5))))
write("fuzz_sdpa", "huge_values", sdpa(mags=(5, 5, 7, 0), flags=W | LSE, E=2, L=4, S=6))
# Variants. Windows: 1 -> 0, 2 -> 1, 3 -> 2, 5 -> 5, 8 -> 39, 9 -> 41, 10 -> 1000, 11 -> 2^62,
# 12 -> INT64_MAX. Softcaps: 1 -> 1.0, 4 -> 20, 11 -> 1e-30, 16 -> 2e38. ALiBi magnitude index
# (bits 1-3): 0 geometric, 1 zero, 4 -> 1.0, 7 -> 1e30. Sinks: 1 -> 1, 2 -> 0, 5 -> 1e4, 7 -> 6e37.
write("fuzz_sdpa", "window_sliding_causal", sdpa(mask=1, L=33, S=33, window=(4, 1), flags=W | LSE | T2))
write("fuzz_sdpa", "window_band_bottom_right", sdpa(L=12, S=30, window=(3, 2), flags=LSE | BR))
write("fuzz_sdpa", "window_left_only_empty_rows", sdpa(L=20, S=6, window=(1, 1), flags=W | LSE))
write("fuzz_sdpa", "window_huge", sdpa(mask=1, window=(12, 11), flags=LSE | BR, L=9, S=4))
write("fuzz_sdpa", "window_beyond_lengths", sdpa(window=(9, 10), mask=2, density=100, flags=W | LSE))
write("fuzz_sdpa", "softcap_20", sdpa(softcap=4, mags=(3, 3, 0, 0), flags=W | LSE, E=16))
write("fuzz_sdpa", "softcap_tiny", sdpa(softcap=11, flags=W | LSE))
write("fuzz_sdpa", "softcap_huge", sdpa(softcap=16, mask=3, density=40, flags=LSE))
write("fuzz_sdpa", "alibi_geometric_h", sdpa(alibi=0x20, mask=1, flags=W | LSE))  # 0x20: layout bits only
write("fuzz_sdpa", "alibi_bh_signed_strided", sdpa(alibi=1 | (4 << 1) | 0x10 | (1 << 5), flags=W | LSE | T2,
                                                    B=2, Hkv=2, group=2, gqa=1))
write("fuzz_sdpa", "alibi_huge", sdpa(alibi=1 | (7 << 1), flags=LSE))
write("fuzz_sdpa", "sinks", sdpa(sinks=1, flags=W | LSE, L=17, S=23))
write("fuzz_sdpa", "sinks_zero_masked_rows", sdpa(sinks=2, mask=2, density=230, flags=W | LSE))
write("fuzz_sdpa", "sinks_large", sdpa(sinks=5, mask=1, L=12, S=5, flags=W | LSE))
write("fuzz_sdpa", "sinks_huge_window_empty", sdpa(sinks=7, window=(1, 1), L=20, S=5, flags=LSE))
write("fuzz_sdpa", "all_variants", sdpa(mask=1, window=(7, 1), softcap=3, alibi=1 | (3 << 1), sinks=1,
                                        dropout=177, flags=W | LSE | T2, B=2, Hkv=2, group=2, L=25, S=25))
write("fuzz_sdpa", "variants_16bit", sdpa(value_seed=40, window=(6, 0), softcap=4, alibi=2 << 1, sinks=1,
                                          mask=1, flags=LSE))
# Found by the target (CI, 2026-11-29): B 2, H 2, L 2, S 1, E 1, Ev 39, a one-element bool mask,
# |v| up to ~200, bf16: with one key P = 1 and dS = dP - D cancels to 0; the bf16 backward's dP
# (dot unit) and D (from the forward's output) round apart by a few float32 units of ~4e5, so dK
# came out 0.023 against a true 0 (check_bf16_backward's float32 cancellation allowance).
write("fuzz_sdpa", "bf16_backward_cancel_s1_large_v", bytes.fromhex(
    "000000020101000601000026d20400000000000007000000800506042a00000000000101000000000000000000000025"))
for kind in range(17):
    write("fuzz_sdpa", f"invalid_{kind:02d}", sdpa(invalid=kind, invalid_arg=(kind * 37 + 1) % 256, mask=2))

# ---- fuzz_paged_attention: see LLVMFuzzerTestOneInput in fuzz_paged_attention.cpp ----------------
# Cache: page (index into 1, 2, 3, 8, 16, 17, 64, 96), kv heads - 1, head dim (index into 4, 16,
# 33, 64, 80, 128), same value dim (1) or not (0, then its index), dtype (f32, bf16, f16, int8),
# pages - 1, a u32 seed. Ops: count, then (kind: 0 add, 1 append, 2 free; id; for append: tokens
# - 1). Call: N - 1, L_q - 1, group (index into 1, 2, 4, 8), per sequence (id; when some id is
# live: 0 keeps that id, else a live one by the next byte), query dtype, is_causal, window (index
# into none, (5, 0), (0, 0), (300, 0), (17, 3), (-1, 2), (40, -1)), softcap (none, 1.5, 30), ALiBi
# (0, or 1 then (H_q) 1 / (N, H_q) 0 and a byte per slope), sinks, kernel (index; past the list:
# the default).
def paged(page, heads, dim, vdim, dtype, pages, ops, N, L, group, seqs, qd=0, causal=0, window=0,
          softcap=0, alibi=(), sinks=0, kernel=255):
    head = b(page, heads, dim, 1 if vdim is None else 0) + (b(vdim) if vdim is not None else b())
    head += b(dtype, pages) + struct.pack("<I", 0x5EED0000 + page * 7 + dim)
    body = b(len(ops)) + b(*[x for op in ops for x in op])
    call = b(N, L, group) + b(*[x for s in seqs for x in s]) + b(qd, causal, window, softcap)
    call += b(*alibi) if alibi else b(0)
    return head + body + call + b(sinks, kernel)

ADD0, ADD1 = (0, 0), (0, 0)
write("fuzz_paged_attention", "single_row_pages16",
      paged(4, 1, 3, None, 0, 63, [ADD0, (1, 0, 39), (1, 0, 39), (1, 0, 39)], 0, 0, 0, [(0, 1, 0)], causal=1))
write("fuzz_paged_attention", "single_row_window_page96",
      paged(7, 0, 5, None, 1, 20, [ADD0, (1, 0, 39), (1, 0, 39), (1, 0, 39), (1, 0, 22)], 0, 0, 0, [(0, 1, 0)],
            window=4))
write("fuzz_paged_attention", "gqa_two_sequences_bf16",
      paged(5, 1, 5, None, 1, 63, [ADD0, ADD1, (1, 0, 39), (1, 1, 39), (1, 0, 39), (2, 1), (0, 0), (1, 2, 20)],
            1, 3, 2, [(0, 1, 0), (2, 1, 1)], qd=1, causal=1, window=3))
write("fuzz_paged_attention", "int8_variants_value_dim",
      paged(3, 2, 4, 2, 3, 30, [ADD0, (1, 0, 30), (1, 0, 30)], 0, 1, 1, [(0, 1, 0)], qd=2, window=5, softcap=1,
            alibi=(1, 0, 3, 9, 27, 81, 5, 6), sinks=1))
write("fuzz_paged_attention", "f16_many_rows",
      paged(6, 0, 1, None, 2, 10, [ADD0, (1, 0, 39), (1, 0, 39)], 2, 3, 3, [(0, 1, 0), (0, 1, 0), (0, 1, 0)],
            causal=1, kernel=1))
write("fuzz_paged_attention", "bad_ids_and_full_pool",
      paged(0, 0, 0, None, 0, 4, [(1, 3, 5), (2, 7), ADD0, (1, 0, 3), (1, 0, 39), (2, 0), (2, 0), (1, 0, 1)],
            0, 0, 0, [(1,)]))
write("fuzz_paged_attention", "too_few_tokens",
      paged(2, 0, 1, None, 0, 8, [ADD0, (1, 0, 1)], 0, 3, 0, [(0, 1, 0)]))
