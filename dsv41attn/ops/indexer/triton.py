"""Triton lightning indexer: the same selections as reference.py (docs/numerics.md §5, step 4).

Flow of one call (every launch on the device, no host sync, so a decode step can be captured):

0. Candidate consumer only (``candidates`` given, ``candidate_topk`` not; past
   COMPACT_MIN_ROWS rows, below which it walks every row as the others): each query tile's
   list of blocks, ascending (``_list_count_kernel`` counts per chunk of LIST_CHUNK blocks,
   ``_list_write_kernel`` writes at the prefix sums): the blocks one of the tile's queries
   keeps, and the blocks holding rows below k. That list holds every row the reference can
   select: the kept rows with finite scores, and the lowest-numbered -inf rows that fill a
   top-k with fewer than k of those (all below k). Scoring and selection run over the list's
   positions (a compact [queries, nblk * block_size] buffer of which each tile's first
   ``nvalid`` positions count: about COMPACT_PROGRAMS scoring programs per chunk, at least
   one per list, take the lists' row tiles in turn, selection programs past a list's end
   exit at once), and ascending order keeps ties to the lower row. Buffers and grids are
   sized from shapes (nblk blocks: no bound on the kept blocks is known here) and the counts
   stay on the device.
1. ``_score_kernel``: one program per (query tile, run of row tiles). A query tile is one
   token (decode) or up to ``PREFILL_TILE`` consecutive tokens of one sequence (they share the
   sequence's keys). Index keys are read straight from the paged pool through the block table
   (as 32-bit words where rows are 4-byte aligned: 68 B at d = 128; else assembled from bytes),
   the next tile's loads issued before this tile's arithmetic, and decoded in registers, 8
   nibbles per word, to the reference's bf16 key values: each nibble becomes the bf16 bits
   s << 15 | code << 6 (the e2m1 value * 2^-126, exactly: e2m1's 0 and 0.5 land on bf16
   subnormals), scaled by two bf16x2 multiplies, by 2^126 and 2^(E-127) (any E; 0 -> 0, 255
   -> inf as the reference; one multiply by 2^(E-1) would cover E <= 128 only, and a
   per-tile choice cost more in register moves than the multiply it saves). The
   index queries are the dot's other operand as given (bf16 fp4 fake-quantised values), so
   one bf16 tl.dot over all d elements, fp32 accumulation, gives each per-head dot: the
   reference's exact products summed in fp32 (bits can move only where that sum rounds, as
   with any order). Per head the dot is rounded to bf16, relu'd, multiplied by its weight and
   rounded to bf16 (packed bf16x2 instructions, two heads at a time: the reference's rounding
   points), then the heads are summed in fp32 and rounded to bf16. Rows a query cannot see,
   and for a candidate consumer rows outside its kept blocks, are -inf and their key bytes are
   never loaded; a tile with nothing to score loads nothing. Scores go to a bf16 buffer
   [queries, rows] (a consumer's: [queries, list positions], row = list[p // block_size] *
   block_size + p % block_size). In a prefill (query tiles over the rows' causal prefixes)
   each query's width is clipped (``_clip_width``): its visible rows, and at least k; the
   rows past it are -inf, and with ties to the lower row a top-k of k never takes one, so
   they are neither scored nor written, and every later step reads a query's first
   ``_clip_width`` entries only (rows, candidate blocks, filter blocks alike). A prefill's
   scoring and selection thus cover the causal triangle, not the square.
2. Candidate source only: ``_block_key_kernel`` takes each block's maximum (the newest
   visible block pinned to +inf) as an ordered 16-bit key per block.
3. Exact top-k by radix select on the ordered 16-bit keys of the bf16 scores (``_order_key``:
   larger key = larger score, -0 = +0, every NaN largest, as torch.sort orders them), rows
   split across programs: ``_hist_kernel`` (twice: the high byte, then the low byte inside
   the high byte's threshold bin; atomic 256-bin histograms) fixes the k-th key u and how many
   rows equal to u are needed; ``_count_kernel`` counts rows above and equal to u per row
   chunk; ``_select_kernel`` writes the selection in ascending row order: every row above u and
   the lowest-numbered rows equal to u, i.e. higher score first, ties to the lower row (SPEC
   §0.2). A source of at most SELECT_ONE_PROGRAM entries a slot (the short contexts' rows
   and candidate blocks) is selected in one program a slot instead (``_select_one_kernel``:
   one launch; u and the count of ties it takes by a binary search over u's 16 bits, each
   step one count of the keys at or above a candidate: against the two register histograms
   it replaced, 12-29% less time over 2048-8192 rows and 2% over 8192 candidate blocks on an
   H100). For top-k rows past a
   query's ``visible`` become -1 (a consumer's list positions
   mapped back to rows first); for candidate blocks the kept mask is written (a block whose
   maximum is -inf is never kept).
4. Large top-k calls (``_filters``: queries x rows past FILTER_MIN_SCORES, rows past
   FILTER_MIN_ROWS, not over a consumer's lists) first filter the rows: a radix select over
   the maxima of FILTER_BLOCK-row blocks gives t, the k-th largest of them, so s_k (the k-th
   largest key) >= t and fewer than k * FILTER_BLOCK rows lie above t. One pass over the
   scores then either writes the selection at once (fewer than k rows above t: s_k = t) or
   lists the rows above t for a radix select over that list, one program a query
   (``_select_filtered``). The 256-bin histograms, the costly part of step 3 (Triton 3.6
   builds one from ballots: about 56 instructions an element), then cover the block maxima
   and the list instead of every row.

The score buffer is bounded by ``score_budget`` bytes: longer prefills run in query chunks.
``reduce`` (tensor parallelism) gets each chunk's score buffer, a consumer's compact one too:
every rank lists the same rows (the kept flags are the same on every rank), and positions
past a tile's count hold no score. A call that is both source and consumer scores every row.
Under TRITON_INTERPRET the dot runs in fp32 on the same exact values (the interpreter has no
inline asm and misreads 16-bit dot operands) and gives the same bits.

Measured (H200, CUDA graphs, bench's indexer cases, V4.1-Flash; scoring / the rest / total
us, the rest's kernels timed eagerly): candidate source b=64 x 64K: 249 / 77 / 336 (key bytes
at 1.14 TB/s, 27% of the 4.2 TB/s copy bandwidth; floor 68 us); b=256 x 64K: 967 / 187 /
1174; b=1 x 1M: 67 / 50 / 128-135; Reindex b=64 x 64K: 87 / 39 / 138-147. Where scoring's time
goes (Nsight Compute, candidate source b=64 x 64K, one launch of the kernel before the
register-pair column order): DRAM at 17% of peak, L1 at 65%, one instruction issued every two
cycles per scheduler, three 4-warp programs per SM (158 registers, 41 KB of shared memory for
the dot's operand and the layout changes). Issuing the page lookups two tiles ahead and
dropping repeated scale-byte loads did not help; fewer instructions per key tile did (the
column order, one decode form, the page size a constant: 886 -> 824 SASS instructions a
thread and tile, scoring 273 -> 247 us). Instruction issue bounds it (docs/benchmarks.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.packing import index_key_bytes
from ..common.triton import (cdiv, check_device, e4m3_of_e2m1, e4m3_to_fp32, interpreting,
                             next_pow2, require, round_bf16, sm_count)

PREFILL_TILE = 4  # queries of one sequence per scoring program (they share the key loads)
SCORE_ROWS = 128  # rows per scoring tile (decode)
PREFILL_SCORE_ROWS = 64  # with PREFILL_TILE queries (H200, prefill 8K: 128-row tiles ran 2x slower)
SCORE_TILES_PER_PROGRAM = 8  # row tiles per scoring program (the query is loaded once)
SCORE_PROGRAMS_PER_SM = 2  # ... fewer while a call's scoring programs would not fill the SMs
SCORE_WARPS = 4  # warps per scoring program (H200: 8 measured slower)
PREFILL_WARPS = 4  # ... with PREFILL_TILE queries
SELECT_CHUNK = 4096  # rows per selection program
# A selection source of at most this many entries a slot (not a consumer's compact lists) is
# selected by one program a slot, in one launch (_select_one_kernel): a decode at short
# contexts (V4.1-Flash up to 8K: the ratio-1 rows, up to 16K the ratio-2 rows, up to 64K the
# candidate blocks) pays one launch instead of four per selection
SELECT_ONE_PROGRAM = 8192
# _select_one_kernel's search for the k-th largest key: bits a step (1 or 2). Each step is a
# block-wide sum, whose shuffles and barriers bound a one-query selection (H100: 5.8 us over
# 2048 rows, 10.7 us in Full r=2's b = 1 timeline); 2 halves the steps for three compares a
# key a step instead of one (the same selection). Not yet timed: bench --part layers --roles
# "Full r=2" --decode 1x4096,256x4096 --prefill "" --variant base --variant
# d2:ops.indexer.triton.SEARCH_DIGIT_BITS=2
SEARCH_DIGIT_BITS = 1
BLOCK_KEYS = 128  # candidate blocks per block-key program
LIST_CHUNK = 4096  # candidate blocks per list-compaction program
# A candidate consumer scores over compact lists only past this many rows (below it, at
# V4.1-Flash's 2048 blocks x 8 rows, a consumer can keep every block: H200, 4K rows, walking
# every row took 53 us at b=64, the lists 56-65 us)
COMPACT_MIN_ROWS = 16384
COMPACT_OWNERS_PER_TILE = 8  # candidate lists per row tile of a scoring program
COMPACT_PROGRAMS = 2048  # scoring programs over the lists of a chunk (at least one per list)
COMPACT_SELECT_CHUNK = 1024  # list positions per selection program
# Large top-k calls are filtered first (step 4 of the flow; _filters)
FILTER_MIN_ROWS = 32768  # rows per query
FILTER_MIN_SCORES = 1 << 21  # queries x rows
FILTER_BLOCK = 16  # rows per block maximum of the filter
FILTER_CHUNK = 4096  # rows per filter program
FILTER_STEP = 1024  # listed rows per step of the filter's selection program

KEY_NINF = tl.constexpr(0x007F)  # _order_key of bf16 -inf: below every other key
KEY_PINF = tl.constexpr(0xFF80)  # _order_key of bf16 +inf


@triton.jit
def _order_key(bits):
    """bf16 bit patterns (int32, 0..65535) -> 16-bit keys ordered as torch.sort orders the
    values: sign-magnitude flipped to two's order, -0 equal to +0, every NaN largest."""
    mag = bits & 0x7FFF
    key = tl.where((bits & 0x8000) != 0, (~bits) & 0xFFFF, bits | 0x8000)
    key = tl.where(mag == 0, 0x8000, key)
    return tl.where(mag > 0x7F80, 0xFFFF, key)


@triton.jit
def _load_keys(src_ptr, offs, mask, FROM_SCORES: tl.constexpr):
    """Keys of a selection source: bf16 scores stored as int16 bits, or int32 keys."""
    if FROM_SCORES:
        bits = tl.load(src_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return _order_key(bits)
    else:
        return tl.load(src_ptr + offs, mask=mask, other=0)


@triton.jit
def _chunk_keys(src_ptr, slot, c, n, stride, CH: tl.constexpr, FROM_SCORES: tl.constexpr):
    """Row chunk ``c`` of query slot ``slot`` of a selection source [slots, stride] whose
    first ``n`` entries count: (positions [CH], in range, keys)."""
    offs = c * CH + tl.arange(0, CH)
    m = offs < n
    return offs, m, _load_keys(src_ptr + slot.to(tl.int64) * stride, offs, m, FROM_SCORES)


@triton.jit
def _clip_width(vis, N, k, UNIT: tl.constexpr):
    """Entries of a selection source [.., N], UNIT rows an entry, that a query seeing ``vis``
    rows needs: those holding one of its visible rows, and at least k. Every later entry is
    -inf (rows past ``vis`` score -inf): with k entries before it and ties to the lower entry,
    the top-k takes none of them."""
    return tl.minimum(N, tl.maximum((vis + UNIT - 1) // UNIT, k))


@triton.jit
def _slot_width(nvalid_ptr, vis_ptr, tok, ok, slot, N, k, UNIT: tl.constexpr,
                TILE: tl.constexpr, COMPACT: tl.constexpr, CLIP: tl.constexpr):
    """Entries of a query slot's selection source: N; for a compact source its list owner's
    (slot // TILE) candidate row count; CLIP (a prefill's causal rows): _clip_width of the
    query's visible rows (token ``tok``, if ``ok``)."""
    if COMPACT:
        return tl.load(nvalid_ptr + slot // TILE)
    elif CLIP:
        return _clip_width(tl.load(vis_ptr + tok, mask=ok, other=0), N, k, UNIT)
    else:
        return N


@triton.jit
def _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base,
                 TILE: tl.constexpr, HAS_TILES: tl.constexpr):
    """(first token, token count) of a query slot's tile; with tiles, slot // TILE is the tile
    (relative to tile_base) and slot % TILE the token in it; without, slot_base + slot."""
    if HAS_TILES:
        tile = tile_base + slot // TILE
        tok = tl.load(tile_tok_ptr + tile) + slot % TILE
        ok = slot % TILE < tl.load(tile_cnt_ptr + tile)
    else:
        tok = (slot_base + slot).to(tl.int64)
        ok = slot >= 0
    return tok, ok


@triton.jit
def _owner_tokens(o, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, HAS_TILES: tl.constexpr):
    """(first token, token count) of query tile ``o`` of the chunk (tiles: relative to
    tile_base; without, one token each from slot_base): a scoring program's, or a candidate
    list's owner."""
    if HAS_TILES:
        tok0 = tl.load(tile_tok_ptr + tile_base + o)
        cnt = tl.load(tile_cnt_ptr + tile_base + o)
    else:
        tok0 = (slot_base + o).to(tl.int64)
        cnt = 1
    return tok0, cnt


# A word of 8 e2m1 nibbles ($8, element t in bits 4t..4t+3) -> 8 bf16 worth the e2m1 values
# times the block's power of two, exactly: nibbles t and t + 4 go to the two halves of one
# 32-bit word as the bf16 bits s << 15 | code << 6 (e1 e0 m: the bf16 exponent's low bits
# and the mantissa's top bit), which is the e2m1 value * 2^-126 (codes 0 and 0.5 land on the
# bf16 subnormals exactly as e2m1's do), then two bf16x2 multiplies, by 2^126 ($9) and by the
# reference's 2^(E-127) ($10: E << 7, so 0 -> 0 and 255 -> inf). Outputs $0..$7: nibbles 0,
# 4, 1, 5, 2, 6, 3, 7 (each pair t, t + 4 one register's halves).
def _nibbles_bf16_asm() -> str:
    shifts = (("shl", 6, 12), ("shl", 2, 8), ("shr", 2, 4), ("shr", 6, 0))
    body = ""
    for j, (op, code_sh, sign_sh) in enumerate(shifts):
        sign = f" shl.b32 b, $8, {sign_sh};" if sign_sh else " mov.b32 b, $8;"
        body += (f" {op}.b32 a, $8, {code_sh};{sign} and.b32 a, a, 0x01C001C0;"
                 f" and.b32 b, b, 0x80008000; or.b32 o, a, b; mul.rn.bf16x2 o, o, $9;"
                 f" mul.rn.bf16x2 o, o, $10; mov.b32 {{${2 * j}, ${2 * j + 1}}}, o;")
    return "{ .reg .b32 a, b, o;" + body + " }"


_NIBBLES_BF16 = tl.constexpr(_nibbles_bf16_asm())
# Per head: the fp32 dot ($2, $3) rounded to bf16, relu'd (NaN kept), times the bf16 weight
# ($4: two packed) rounded to bf16, back as fp32 ($0, $1): the reference's rounding points,
# two heads per instruction.
_HEAD_TERMS_ASM = tl.constexpr(
    "{ .reg .b32 p, z; mov.b32 z, 0; cvt.rn.bf16x2.f32 p, $3, $2; max.NaN.bf16x2 p, p, z;"
    " mul.rn.bf16x2 p, p, $4; shl.b32 $0, p, 16; and.b32 $1, p, 0xFFFF0000; }")


@triton.jit
def _key_raw(pool_ptr, base, live, D: tl.constexpr, WORDS: tl.constexpr):
    """Issue the loads of the key rows at byte offsets ``base`` [BN]: (codes: D/8 int32 words
    [BN, D/8], element 8w + t in bits 4t..4t+3 of word w (WORDS: 4-byte aligned rows, loaded
    as words; else assembled from bytes); the scale blocks' ue8m0 bytes [BN, D/32] as
    int32)."""
    NW: tl.constexpr = D // 8
    offs_w = tl.arange(0, NW)
    if WORDS:
        wptr = pool_ptr.to(tl.pointer_type(tl.int32)) + base[:, None] // 4
        raw = tl.load(wptr + offs_w[None, :], mask=live[:, None], other=0)
    else:
        b = tl.load(pool_ptr + base[:, None] + tl.arange(0, D // 2)[None, :],
                    mask=live[:, None], other=0).to(tl.int32)
        b = tl.reshape(b, (b.shape[0], NW, 4)) << (8 * tl.arange(0, 4))[None, None, :]
        raw = tl.sum(b, 2)  # disjoint bits: the sum is the or
    NB: tl.constexpr = D // 32
    e = tl.load(pool_ptr + base[:, None] + (D // 2 + tl.arange(0, NB))[None, :],
                mask=live[:, None], other=0).to(tl.int32)
    return raw, e


@triton.jit
def _per_word(x):
    """[BN, D/32] per scale block -> [BN, D/8] per code word (4 words a block)."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], 4)),
                      (x.shape[0], x.shape[1] * 4))


@triton.jit
def _key_tile(raw, e, INTERPRET: tl.constexpr):
    """_key_raw's loads -> the key values [BN, D] (bf16; fp32 under the interpreter): e2m1 *
    2^(E-127) exactly, as the reference decodes them, in the column order of the comment
    below."""
    BN: tl.constexpr = raw.shape[0]
    NW: tl.constexpr = raw.shape[1]
    D: tl.constexpr = NW * 8
    if INTERPRET:
        scale = _per_word((e << 23).to(tl.float32, bitcast=True))  # 0 -> 0, as the reference
        e0, e1, e2, e3, e4, e5, e6, e7 = (
            e4m3_to_fp32(e4m3_of_e2m1(((raw >> (4 * t)) & 15).to(tl.uint8))) * 64.0 * scale
            for t in tl.static_range(8))
    else:
        f1 = tl.full(raw.shape, 0x7E807E80, tl.int32)  # 2^126
        f2 = _per_word((e << 7) | (e << 23))
        e0, e4, e1, e5, e2, e6, e3, e7 = tl.inline_asm_elementwise(
            _NIBBLES_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [raw, f1, f2],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    # columns 8w .. 8w + 7 hold nibbles 0, 4, 1, 5, 2, 6, 3, 7 of word w: each pair (t, t + 4)
    # stays as the multiply left it, in one register; _q_operand orders the queries alike
    v = tl.join(tl.join(tl.join(e0, e2), tl.join(e1, e3)),
                tl.join(tl.join(e4, e6), tl.join(e5, e7)))
    return tl.reshape(v, (BN, D))


@triton.jit
def _tile_fetch(pool_ptr, bt_ptr, keep_ptr, list_ptr, row, tok0, offs_m, m_ok, vis, g0, g_end,
                bt_stride, page_rows, keep_stride, D: tl.constexpr, BN: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, WORDS: tl.constexpr, HAS_KEEP: tl.constexpr,
                COMPACT: tl.constexpr):
    """The loads of one tile of positions g0 .. g0 + BN - 1 (none at or past ``g_end``): the
    rows themselves, or for a compact tile the rows its positions stand for in the tile's
    block list (list_ptr); which (position, query) pairs are scored, which rows are read, the
    raw key words and scale bytes."""
    if COMPACT:
        offs_p = g0 + tl.arange(0, BN)
        in_p = offs_p < g_end
        blk = tl.load(list_ptr + offs_p // BLOCK_SIZE, mask=in_p, other=0)
        offs_g = blk * BLOCK_SIZE + offs_p % BLOCK_SIZE
        seen = (offs_g[:, None] < vis[None, :]) & in_p[:, None]  # [BN, TILE]
    else:
        offs_g = g0 + tl.arange(0, BN)
        seen = (offs_g[:, None] < vis[None, :]) & (offs_g < g_end)[:, None]  # [BN, TILE]
    if HAS_KEEP:
        if COMPACT:
            kept = tl.load(keep_ptr + (tok0 + offs_m)[None, :] * keep_stride + blk[:, None],
                           mask=m_ok[None, :] & seen, other=0) != 0
        else:
            kept = tl.load(keep_ptr + (tok0 + offs_m)[None, :] * keep_stride
                           + (offs_g // BLOCK_SIZE)[:, None],
                           mask=m_ok[None, :] & seen, other=0) != 0
        seen = seen & kept
    need = tl.max(seen.to(tl.int32), 1) != 0  # [BN]: some query of the tile scores it
    page = tl.load(bt_ptr + row * bt_stride + offs_g // page_rows, mask=need, other=-1)
    live = need & (page >= 0)  # unallocated pages read as zero keys, as the reference
    # [BN] byte offsets. A row starts on a 4-byte boundary at best (68 B): say so, or the
    # compiler, seeing runs of consecutive slots, vectorises misaligned loads
    base = tl.multiple_of((page * page_rows + offs_g % page_rows) * (D // 2 + D // 32), 1)
    raw, e = _key_raw(pool_ptr, base, live, D, WORDS)
    return seen, need, raw, e


@triton.jit
def _q_operand(q_ptr, q_off, r_ok, D: tl.constexpr, INTERPRET: tl.constexpr):
    """The index queries as the dot's right operand [D, rows] (bf16 as given: the fp4
    fake-quantised values; fp32 under the interpreter)."""
    col = tl.arange(0, D)
    kk = col - col % 8 + (col % 2) * 4 + (col % 8) // 2  # _key_tile's column order
    v = tl.load(q_ptr + q_off[None, :] + kk[:, None], mask=r_ok[None, :], other=0.0)
    if INTERPRET:
        v = v.to(tl.float32)
    return v


@triton.jit
def _tile_start(it, g_first, tiles_per_prog, BN: tl.constexpr, COMPACT: tl.constexpr):
    """First position of a scoring program's tile ``it``: its run of tiles_per_prog tiles
    from g_first, or over candidate lists (COMPACT) the runs j, j + programs, ... in turn
    (program j)."""
    if COMPACT:
        run = tl.program_id(1) + (it // tiles_per_prog) * tl.num_programs(1)
        return (run * tiles_per_prog + it % tiles_per_prog) * BN
    else:
        return g_first + it * BN


@triton.jit
def _score_kernel(q_ptr, w_ptr, pool_ptr, bt_ptr, vis_ptr, row_ptr, keep_ptr, list_ptr,
                  nvalid_ptr, out_ptr, hist_ptr, tile_tok_ptr, tile_cnt_ptr, tile_base,
                  slot_base, N, k, head_scale, slots, bt_stride, keep_stride, list_stride,
                  tiles_per_prog, PAGE_ROWS: tl.constexpr,
                  I: tl.constexpr, I_PAD: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                  BN: tl.constexpr, BLOCK_SIZE: tl.constexpr, WORDS: tl.constexpr,
                  HAS_TILES: tl.constexpr, HAS_KEEP: tl.constexpr, COMPACT: tl.constexpr,
                  CLIP: tl.constexpr, NZ: tl.constexpr, INTERPRET: tl.constexpr):
    """q: [T, I, D] bf16; w: [T, I] bf16, times head_scale (rounded to bf16); pool: uint8
    key rows (D/2 bytes of e2m1 pairs, then D/32 ue8m0 bytes), PAGE_ROWS rows a page (a
    constant: the page lookup divides by it);
    bt: [B, pages] int64; vis, row: [T] int64; keep: uint8 [T,
    keep_stride] (HAS_KEEP); out: int16 [slots, N] bf16 bits, slot = the query's place in
    this call's chunk. COMPACT: out's position p of query tile t stands for row
    list[t, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE, for p below nvalid[t] (list:
    int32 [tiles, list_stride]; positions past nvalid[t] are not written), and program j of
    a tile scores its list's runs of tiles_per_prog row tiles j, j + programs, ... (one past
    them loads nothing). Grid (chunk tiles, cdiv(N, BN * tiles_per_prog), over lists at most
    COMPACT_PROGRAMS / tiles of them). CLIP (never with COMPACT): rows past the tile's
    queries' _clip_width for a top-k of k are neither scored nor written (no selection reads
    them). hist: int32 [NZ, 2, slots, 256], the histograms of the radix selections that
    follow this launch and need them (NZ = 0: none, hist None): program (t, 0) zeroes its
    tile's slots in them (no zeroing launch of their own).

    The key elements are the reference's bf16 values (e2m1 times the block's power of two),
    the query elements the given bf16 ones: one bf16 dot over all D elements with fp32
    accumulation sums the reference's exact products, as its matmul does."""
    R: tl.constexpr = TILE * I_PAD  # (token, head) columns of the dot
    tile = tl.program_id(0)
    if tl.program_id(1) == 0:  # this tile's slots of the selections' histograms, zeroed
        offs_z = (tile * TILE + tl.arange(0, TILE))[:, None] * 256 + tl.arange(0, 256)[None, :]
        for j in tl.static_range(2 * NZ):
            tl.store(hist_ptr + j * slots * 256 + offs_z, tl.zeros([TILE, 256], tl.int32))
    tok0, cnt = _owner_tokens(tile, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, HAS_TILES)
    if COMPACT:
        pid = tl.program_id(1)
        n_prog = tl.num_programs(1)
        n = tl.load(nvalid_ptr + tile)  # this tile's candidate positions
        lst = list_ptr + tile.to(tl.int64) * list_stride
        runs = (n + tiles_per_prog * BN - 1) // (tiles_per_prog * BN)  # runs of row tiles
        n_it = (tl.maximum(runs - pid, 0) + n_prog - 1) // n_prog * tiles_per_prog
        live = tl.where(pid < runs, cnt, 0)  # a program past them loads nothing
    else:
        n = N
        lst = list_ptr
        n_it = tiles_per_prog
        live = cnt
    row = tl.load(row_ptr + tok0)
    offs_m = tl.arange(0, TILE)
    m_ok = offs_m < live
    vis = tl.load(vis_ptr + tok0 + offs_m, mask=m_ok, other=0)  # [TILE]
    g_first = tl.program_id(1) * tiles_per_prog * BN
    if CLIP:  # the row tiles below the widest query's clipped width only
        w_rows = _clip_width(tl.max(vis, 0).to(tl.int32), N, k, 1)
        n_it = tl.minimum(n_it, tl.maximum(w_rows - g_first + BN - 1, 0) // BN)
    offs_r = tl.arange(0, R)
    r_tok = offs_r // I_PAD
    r_head = offs_r % I_PAD
    r_ok = (r_tok < live) & (r_head < I)
    q_off = (tok0 + r_tok) * (I * D) + r_head * D
    qv = _q_operand(q_ptr, q_off, r_ok, D, INTERPRET)
    wv = tl.load(w_ptr + (tok0 + r_tok) * I + r_head, mask=r_ok, other=0.0)
    if INTERPRET:
        wv = round_bf16(wv.to(tl.float32) * head_scale, INTERPRET)  # bf16(w * scale)
    else:  # the same, two weights a register
        wv = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; .reg .f32 x, y, s; shl.b32 a, $1, 16; and.b32 b, $1, 0xFFFF0000;"
            " mov.b32 x, a; mov.b32 y, b; mov.b32 s, $2; mul.rn.f32 x, x, s; mul.rn.f32 y, y, s;"
            " cvt.rn.bf16x2.f32 $0, y, x; }",
            "=r,r,r,r", [wv, tl.full(wv.shape, head_scale, tl.float32)], dtype=tl.bfloat16,
            is_pure=True, pack=2)
    out_cols = out_ptr + (tile.to(tl.int64) * TILE + offs_m.to(tl.int64))[None, :] * N
    if COMPACT:
        g_end = n
    else:
        g_end = tl.minimum(N, g_first + tiles_per_prog * BN)  # this program's rows end there
    seen, need, raw, e = _tile_fetch(
        pool_ptr, bt_ptr, keep_ptr, lst, row, tok0, offs_m, m_ok, vis, g_first, g_end,
        bt_stride, PAGE_ROWS, keep_stride, D, BN, BLOCK_SIZE, WORDS, HAS_KEEP, COMPACT)
    for it in range(n_it):
        # positions (rows unless COMPACT)
        offs_g = _tile_start(it, g_first, tiles_per_prog, BN, COMPACT) + tl.arange(0, BN)
        # the next tile's loads go out before this tile's arithmetic (software pipelining)
        n_seen, n_need, n_raw, n_e = _tile_fetch(
            pool_ptr, bt_ptr, keep_ptr, lst, row, tok0, offs_m, m_ok, vis,
            _tile_start(it + 1, g_first, tiles_per_prog, BN, COMPACT), g_end,
            bt_stride, PAGE_ROWS, keep_stride, D, BN, BLOCK_SIZE, WORDS, HAS_KEEP, COMPACT)
        store_ok = (offs_g < n)[:, None] & m_ok[None, :]
        if tl.sum(need.to(tl.int32), 0) == 0:
            tl.store(out_cols + offs_g[:, None], tl.full([BN, TILE], 0xFF80, tl.int32)
                     .to(tl.int16), mask=store_ok)  # -inf
        else:
            # one dot over the whole row: every scale folded into its key element (exact in
            # bf16)
            kc = _key_tile(raw, e, INTERPRET)
            acc = tl.dot(kc, qv)  # [BN, R]
            if INTERPRET:
                s = round_bf16(acc, INTERPRET)  # the per-head bf16 dot
                s = tl.where(s < 0, 0.0, s)  # relu (NaN kept)
                prod = round_bf16(s * wv[None, :], INTERPRET)
            else:
                prod = tl.inline_asm_elementwise(
                    _HEAD_TERMS_ASM, "=r,=r,r,r,r", [acc, tl.broadcast_to(wv[None, :], acc.shape)],
                    dtype=tl.float32, is_pure=True, pack=2)
            score = round_bf16(tl.sum(tl.reshape(prod, [BN, TILE, I_PAD]), 2), INTERPRET)
            score = tl.where(seen, score, float("-inf"))
            bits = (score.to(tl.uint32, bitcast=True) >> 16).to(tl.int32)
            tl.store(out_cols + offs_g[:, None], bits.to(tl.int16), mask=store_ok)
        seen, need, raw, e = n_seen, n_need, n_raw, n_e


@triton.jit
def _block_key_kernel(src_ptr, key_ptr, vis_ptr, tile_tok_ptr, tile_cnt_ptr,
                      tile_base, slot_base, N, nblk, k,
                      BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr, BB: tl.constexpr,
                      TILE: tl.constexpr, HAS_TILES: tl.constexpr, PIN: tl.constexpr,
                      CLIP: tl.constexpr):
    """src: int16 [slots, N] bf16 score bits; key: int32 [slots, nblk] block keys: the max key
    of the block's rows; PIN: the newest visible block's KEY_PINF (the candidate source's).
    CLIP: only the blocks a top-k of k of them reads (_clip_width), from the visible rows
    only (the rest are -inf; a clipped scoring may not have written them). Grid (slots,
    cdiv(nblk, BB))."""
    slot = tl.program_id(0)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                           HAS_TILES)
    if ok:
        vis = 0
        if CLIP or PIN:  # the query's visible rows: only these read them
            vis = tl.load(vis_ptr + tok)
        live = _slot_width(None, vis_ptr, tok, ok, slot, nblk, k, BLOCK_SIZE, TILE, False, CLIP)
        if tl.program_id(1) * BB < live:
            offs_b = tl.program_id(1) * BB + tl.arange(0, BB)
            bk = _block_max_keys(src_ptr + slot.to(tl.int64) * N, offs_b, N, vis, BLOCK_SIZE,
                                 BS_PAD, PIN, CLIP, False)
            tl.store(key_ptr + slot.to(tl.int64) * nblk + offs_b, bk, mask=offs_b < live)


@triton.jit
def _block_max_keys(row_ptr, offs_b, N, vis, BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr,
                    PIN: tl.constexpr, CLIP: tl.constexpr, BY_ROW: tl.constexpr):
    """Keys of blocks offs_b of one slot's bf16 scores (row_ptr: int16 [N] bits): each
    block's largest key over its rows (rows past N, and CLIP past the ``vis`` visible rows,
    -inf: a clipped scoring may not have written them); PIN: the newest visible block
    KEY_PINF (the candidate source's). BY_ROW: one load of every block's e-th row at a time
    ([len(offs_b)] live keys instead of [len(offs_b), BS_PAD]): the same maxima."""
    if BY_ROW:
        bk = tl.full(offs_b.shape, KEY_NINF, tl.int32)
        for e in range(BLOCK_SIZE):  # a loop, not unrolled: one row's keys live at a time
            g = offs_b * BLOCK_SIZE + e
            m = g < N
            if CLIP:
                m = m & (g < vis)
            bk = tl.maximum(bk, tl.where(m, _load_keys(row_ptr, g, m, True), KEY_NINF))
    else:
        offs_e = tl.arange(0, BS_PAD)
        g = offs_b[:, None] * BLOCK_SIZE + offs_e[None, :]
        m = (offs_e[None, :] < BLOCK_SIZE) & (g < N)
        if CLIP:
            m = m & (g < vis)
        keys = _load_keys(row_ptr, g, m, True)
        keys = tl.where(m, keys, KEY_NINF)  # padding past N is -inf, as the reference's
        bk = tl.max(keys, 1)
    if PIN:
        newest = tl.where(vis > 0, (vis - 1) // BLOCK_SIZE, -1)  # vis 0: none pinned
        bk = tl.where(offs_b == newest, KEY_PINF, bk)
    return bk


@triton.jit
def _listed(cand_ptr, tok0, cnt, offs_b, nblk, first, cand_stride, TILE: tl.constexpr):
    """Which blocks offs_b [LCH] a list owner (tokens tok0 .. tok0 + cnt - 1) lists: those
    one of its tokens keeps, and the ``first`` blocks (rows below k)."""
    f = offs_b < first
    for i in tl.static_range(TILE):
        lim = nblk
        if i > 0:
            lim = tl.where(cnt > i, nblk, 0)  # the owner's token i, if it has one
        f = f | (tl.load(cand_ptr + (tok0 + i) * cand_stride + offs_b, mask=offs_b < lim,
                         other=0) != 0)
    return f & (offs_b < nblk)


@triton.jit
def _list_count_kernel(cand_ptr, lcnt_ptr, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base,
                       nblk, first, cand_stride, nlch, LCH: tl.constexpr, TILE: tl.constexpr,
                       HAS_TILES: tl.constexpr):
    """lcnt: int32 [owners, nlch]: the blocks each chunk of LCH blocks lists (_listed).
    Grid (owners, nlch)."""
    o = tl.program_id(0)
    c = tl.program_id(1)
    tok0, cnt = _owner_tokens(o, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, HAS_TILES)
    offs_b = c * LCH + tl.arange(0, LCH)
    f = _listed(cand_ptr, tok0, cnt, offs_b, nblk, first, cand_stride, TILE)
    tl.store(lcnt_ptr + o * nlch + c, tl.sum(f.to(tl.int32), 0))


@triton.jit
def _list_write_kernel(cand_ptr, lcnt_ptr, list_ptr, nvalid_ptr, tile_tok_ptr, tile_cnt_ptr,
                       tile_base, slot_base, nblk, first, cand_stride, nlch, n_rows,
                       list_stride, LCH: tl.constexpr, NLCH_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_TILES: tl.constexpr):
    """list: int32 [owners, list_stride]: each owner's listed blocks ascending; nvalid: int32
    [owners]: the rows they hold (the partial last block's real rows only). Grid (owners,
    nlch)."""
    o = tl.program_id(0)
    c = tl.program_id(1)
    tok0, cnt = _owner_tokens(o, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, HAS_TILES)
    prev = tl.arange(0, NLCH_PAD)
    before = tl.sum(tl.load(lcnt_ptr + o * nlch + prev, mask=prev < c, other=0), 0)
    offs_b = c * LCH + tl.arange(0, LCH)
    f = _listed(cand_ptr, tok0, cnt, offs_b, nblk, first, cand_stride, TILE).to(tl.int32)
    pos = before + tl.cumsum(f, 0) - f
    tl.store(list_ptr + o.to(tl.int64) * list_stride + pos, offs_b, mask=f != 0)
    if c == nlch - 1:
        total = before + tl.sum(f, 0)
        last = tl.sum(tl.where(offs_b == nblk - 1, f, 0), 0)  # the last block, maybe partial
        tl.store(nvalid_ptr + o, total * BLOCK_SIZE - last * (nblk * BLOCK_SIZE - n_rows))


@triton.jit
def _threshold_of(h, n, k):
    """From a 256-bin histogram h of n keys' bytes: the bin b holding the k-th largest, and
    how many keys lie in bins above it and in it."""
    bins = tl.arange(0, 256)
    incl = tl.cumsum(h, 0)
    b = tl.sum((incl - h <= n - k).to(tl.int32), 0) - 1
    above = n - tl.sum(tl.where(bins == b, incl, 0), 0)
    in_bin = tl.sum(tl.where(bins == b, h, 0), 0)
    return b, above, in_bin


@triton.jit
def _threshold(hist_ptr, n, k):
    """_threshold_of a histogram in memory."""
    return _threshold_of(tl.load(hist_ptr + tl.arange(0, 256)), n, k)


@triton.jit
def _byte_hist(byte, m):
    """256-bin histogram of the bytes where m holds."""
    bins = tl.arange(0, 256)
    h = tl.histogram(tl.where(m, byte, 0), 256)
    return h - tl.where(bins == 0, byte.shape[0] - tl.sum(m.to(tl.int32), 0), 0)  # masked lanes


@triton.jit
def _hist_kernel(src_ptr, hist_hi_ptr, hist_lo_ptr, nvalid_ptr, vis_ptr, tile_tok_ptr,
                 tile_cnt_ptr, tile_base, slot_base, N, k, LOW: tl.constexpr, CH: tl.constexpr,
                 TILE: tl.constexpr, HAS_TILES: tl.constexpr, FROM_SCORES: tl.constexpr,
                 COMPACT: tl.constexpr, CLIP: tl.constexpr, UNIT: tl.constexpr):
    """Radix select, one level: the high bytes' histogram (LOW false) or, inside the high
    byte's threshold bin, the low bytes' (LOW true). hist_*: int32 [slots, 256], zeroed.
    src: [slots, N], of which a slot counts its first _slot_width entries only (a chunk past
    them does nothing). Grid (slots, cdiv(N, CH))."""
    slot = tl.program_id(0)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                         HAS_TILES)
    n = _slot_width(nvalid_ptr, vis_ptr, tok, ok, slot, N, k, UNIT, TILE, COMPACT, CLIP)
    ok = ok & (tl.program_id(1) * CH < n)
    if ok:
        offs, m, key = _chunk_keys(src_ptr, slot, tl.program_id(1), n, N, CH, FROM_SCORES)
        bins = tl.arange(0, 256)
        if LOW:
            b, above, in_bin = _threshold(hist_hi_ptr + slot * 256, n, k)
            m = m & ((key >> 8) == b)
            byte = key & 0xFF
            dst = hist_lo_ptr
        else:
            byte = key >> 8
            dst = hist_hi_ptr
        h = _byte_hist(byte, m)
        tl.atomic_add(dst + slot * 256 + bins, h, mask=h != 0)


@triton.jit
def _kth_key(key, m, k, DIGIT: tl.constexpr = 1):
    """(u, need) of the 16-bit keys where m holds: u the k-th largest of them, need how many
    keys equal to u the top-k takes (k minus the keys above u), by a search over u's bits,
    high to low: u is the largest t with at least k keys >= t. The same u and need as the two
    radix levels of _threshold_of (with fewer than k keys, every key is taken either way).
    DIGIT = 1: one bit a step, one count (a block-wide sum) each. DIGIT = 2: two bits a step,
    the counts of the keys >= each of the digit's three candidates packed 16 bits apart in
    one int64 sum (at most 8192 keys a program, so no count reaches 2^16), half the steps and
    their reductions; the counts fall as the candidate grows, so the digit is how many of
    them reach k: the same u."""
    u = 0
    if DIGIT == 1:
        for bit in tl.static_range(15, -1, -1):
            t = u | (1 << bit)
            u = tl.where(tl.sum((m & (key >= t)).to(tl.int32), 0) >= k, t, u)
    else:
        tl.static_assert(DIGIT == 2)
        tl.static_assert(key.shape[0] < 65536)
        for bit in tl.static_range(14, -1, -2):
            packed = ((key >= (u | (1 << bit))).to(tl.int64)
                      + ((key >= (u | (2 << bit))).to(tl.int64) << 16)
                      + ((key >= (u | (3 << bit))).to(tl.int64) << 32))
            c = tl.sum(tl.where(m, packed, 0), 0)
            d = ((c & 0xFFFF) >= k).to(tl.int32) + (((c >> 16) & 0xFFFF) >= k).to(tl.int32) \
                + ((c >> 32) >= k).to(tl.int32)
            u = u | (d << bit)
    return u, k - tl.sum((m & (key > u)).to(tl.int32), 0)


@triton.jit
def _cut(hist_hi_ptr, hist_lo_ptr, N, k):
    """The k-th largest key u and how many keys equal to u the selection takes."""
    b, above, in_bin = _threshold(hist_hi_ptr, N, k)
    lo, above_lo, in_lo = _threshold(hist_lo_ptr, in_bin, k - above)
    return b * 256 + lo, k - above - above_lo


@triton.jit
def _take(key, m, u, need, gt_before, eq_before):
    """The selection's rule over one run of keys (m: in range), given the k-th largest key u,
    how many keys equal to u it takes (need) and how many keys above and equal to u came
    before the run: every key above u and the first ``need`` equal to it, i.e. ties to the
    lower position. Returns (taken [run] bool, each taken key's place in the output, the run's
    keys above u, the run's keys equal to u)."""
    gt = (m & (key > u)).to(tl.int32)
    eq = (m & (key == u)).to(tl.int32)
    eq_rank = eq_before + tl.cumsum(eq, 0) - eq
    take = (gt != 0) | ((eq != 0) & (eq_rank < need))
    t32 = take.to(tl.int32)
    pos = gt_before + tl.minimum(eq_before, need) + tl.cumsum(t32, 0) - t32
    return take, pos, tl.sum(gt, 0), tl.sum(eq, 0)


@triton.jit
def _count_kernel(src_ptr, hist_hi_ptr, hist_lo_ptr, cnt_ptr, nvalid_ptr, vis_ptr,
                  tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, N, k, nch, nb,
                  CH: tl.constexpr, TILE: tl.constexpr, HAS_TILES: tl.constexpr,
                  FROM_SCORES: tl.constexpr, COMPACT: tl.constexpr, FILTER: tl.constexpr,
                  CLIP: tl.constexpr, UNIT: tl.constexpr, FB: tl.constexpr):
    """cnt: int32 [slots, 2, nch]: per row chunk, the keys above u and equal to u (chunks past
    a slot's _slot_width entries are left unwritten: no live chunk reads them). u: the k-th
    largest key of the histograms' keys: the slot's own, or FILTER the block maxima of
    _select_filtered (nb of them, FB rows each)."""
    slot = tl.program_id(0)
    c = tl.program_id(1)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                         HAS_TILES)
    n = _slot_width(nvalid_ptr, vis_ptr, tok, ok, slot, N, k, UNIT, TILE, COMPACT, CLIP)
    ok = ok & (c * CH < n)
    if ok:
        if FILTER:
            n_cut = _slot_width(nvalid_ptr, vis_ptr, tok, ok, slot, nb, k, FB, TILE, False,
                                CLIP)
        else:
            n_cut = n
        u, need = _cut(hist_hi_ptr + slot * 256, hist_lo_ptr + slot * 256, n_cut, k)
        offs, m, key = _chunk_keys(src_ptr, slot, c, n, N, CH, FROM_SCORES)
        gt = tl.sum((m & (key > u)).to(tl.int32), 0)
        eq = tl.sum((m & (key == u)).to(tl.int32), 0)
        tl.store(cnt_ptr + slot * 2 * nch + c, gt)
        tl.store(cnt_ptr + slot * 2 * nch + nch + c, eq)


@triton.jit
def _select_kernel(src_ptr, hist_hi_ptr, hist_lo_ptr, cnt_ptr, out_ptr, vis_ptr, nvalid_ptr,
                   list_ptr, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, N, k, nch,
                   out_stride, list_stride, CH: tl.constexpr, NCH_PAD: tl.constexpr,
                   TILE: tl.constexpr, HAS_TILES: tl.constexpr, FROM_SCORES: tl.constexpr,
                   MASK_OUT: tl.constexpr, COMPACT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   CLIP: tl.constexpr, UNIT: tl.constexpr):
    """Write the selection of one row chunk, rows ascending. MASK_OUT false: out int32 [T, k]
    row numbers (-1 past the query's visible); true: out uint8 [T, N] kept flags (key above
    -inf; 0 past the slot's _slot_width entries). A compact source's position p is row
    list[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE (list: int32 [owners, list_stride]
    ascending blocks). Grid (slots, nch)."""
    slot = tl.program_id(0)
    c = tl.program_id(1)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                           HAS_TILES)
    n = _slot_width(nvalid_ptr, vis_ptr, tok, ok, slot, N, k, UNIT, TILE, COMPACT, CLIP)
    if MASK_OUT:
        if ok & (c * CH >= n):  # a chunk past the entries: nothing kept
            offs = c * CH + tl.arange(0, CH)
            tl.store(out_ptr + tok * out_stride + offs, tl.zeros([CH], tl.uint8), mask=offs < N)
    if ok & (c * CH < n):
        u, need = _cut(hist_hi_ptr + slot * 256, hist_lo_ptr + slot * 256, n, k)
        prev = tl.arange(0, NCH_PAD)
        before = prev < c
        gt_before = tl.sum(tl.load(cnt_ptr + slot * 2 * nch + prev, mask=before, other=0), 0)
        eq_before = tl.sum(tl.load(cnt_ptr + slot * 2 * nch + nch + prev, mask=before,
                                   other=0), 0)
        offs, m, key = _chunk_keys(src_ptr, slot, c, n, N, CH, FROM_SCORES)
        take, pos, _, _ = _take(key, m, u, need, gt_before, eq_before)
        if MASK_OUT:
            tl.store(out_ptr + tok * out_stride + offs, (take & (key > KEY_NINF)).to(tl.uint8),
                     mask=offs < N)  # past n: not taken
        else:
            vis = tl.load(vis_ptr + tok)
            if COMPACT:
                blk = tl.load(list_ptr + (slot // TILE).to(tl.int64) * list_stride
                              + offs // BLOCK_SIZE, mask=take, other=0)
                row = blk * BLOCK_SIZE + offs % BLOCK_SIZE
            else:
                row = offs
            val = tl.where(row < vis, row, -1)
            tl.store(out_ptr + tok * out_stride + pos, val, mask=take)


@triton.jit
def _select_one_kernel(src_ptr, out_ptr, vis_ptr, tile_tok_ptr, tile_cnt_ptr, tile_base,
                       slot_base, N, k, out_stride, n_rows, CH: tl.constexpr,
                       TILE: tl.constexpr, HAS_TILES: tl.constexpr, FROM_SCORES: tl.constexpr,
                       MASK_OUT: tl.constexpr, CLIP: tl.constexpr, UNIT: tl.constexpr,
                       BLOCKS: tl.constexpr, DIGIT: tl.constexpr = 1):
    """_select for a source of N <= CH entries a slot, in one program a slot: the k-th largest
    key u and the ties it takes (_kth_key: the same u and count as the radix passes' two
    histograms), then the selection written as _select_kernel writes it (the whole source is
    its one chunk, so nothing comes before it). BLOCKS (the candidate source's kept blocks,
    MASK_OUT): the entries are the blocks of UNIT rows of bf16 scores src [slots, n_rows], each
    block's key made here as _block_key_kernel makes it (PIN), so no block-key launch. Grid
    (slots,)."""
    slot = tl.program_id(0)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                           HAS_TILES)
    if ok:
        n = _slot_width(None, vis_ptr, tok, ok, slot, N, k, UNIT, TILE, False, CLIP)
        if BLOCKS:
            offs = tl.arange(0, CH)
            m = offs < n
            key = _block_max_keys(src_ptr + slot.to(tl.int64) * n_rows, offs, n_rows,
                                  tl.load(vis_ptr + tok), UNIT, UNIT, True, CLIP, True)
        else:
            offs, m, key = _chunk_keys(src_ptr, slot, 0, n, N, CH, FROM_SCORES)
        u, need = _kth_key(key, m, k, DIGIT)
        take, pos, _, _ = _take(key, m, u, need, 0, 0)
        if MASK_OUT:  # past n: not taken, so 0
            tl.store(out_ptr + tok * out_stride + offs, (take & (key > KEY_NINF)).to(tl.uint8),
                     mask=offs < N)
        else:
            vis = tl.load(vis_ptr + tok)
            tl.store(out_ptr + tok * out_stride + pos, tl.where(offs < vis, offs, -1),
                     mask=take)


@triton.jit
def _filter_write_kernel(src_ptr, hist_hi_ptr, hist_lo_ptr, cnt_ptr, gt_ptr, out_ptr, vis_ptr,
                         tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, N, k, nch, nb,
                         gcap, out_stride, CH: tl.constexpr, NCH_PAD: tl.constexpr,
                         TILE: tl.constexpr, HAS_TILES: tl.constexpr, CLIP: tl.constexpr,
                         FB: tl.constexpr):
    """One row chunk of _select_filtered, t the k-th largest block maximum: with G >= k keys
    above t in the slot, its keys above t to the list gt [slots, gcap] at the prefix of the
    chunks before (rows ascending); with fewer, the k-th largest key is t itself, and the
    chunk's share of the selection (every key above t, the first k - G equal to it) goes to
    out as _select_kernel writes it. CLIP: over the slot's _clip_width rows (and block
    maxima of FB rows) only. Grid (slots, nch)."""
    slot = tl.program_id(0)
    c = tl.program_id(1)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                           HAS_TILES)
    vis = tl.load(vis_ptr + tok, mask=ok, other=0)
    n = _slot_width(None, vis_ptr, tok, ok, slot, N, k, 1, TILE, False, CLIP)
    n_cut = _slot_width(None, vis_ptr, tok, ok, slot, nb, k, FB, TILE, False, CLIP)
    if ok & (c * CH < n):
        t = _cut(hist_hi_ptr + slot * 256, hist_lo_ptr + slot * 256, n_cut, k)[0]
        prev = tl.arange(0, NCH_PAD)
        gts = tl.load(cnt_ptr + slot * 2 * nch + prev, mask=prev * CH < n, other=0)
        eqs = tl.load(cnt_ptr + slot * 2 * nch + nch + prev, mask=prev < c, other=0)
        g_total = tl.sum(gts, 0)
        gt_before = tl.sum(tl.where(prev < c, gts, 0), 0)
        offs, m, key = _chunk_keys(src_ptr, slot, c, n, N, CH, True)
        gt = (m & (key > t)).to(tl.int32)
        if g_total >= k:
            pos = gt_before + tl.cumsum(gt, 0) - gt
            tl.store(gt_ptr + slot.to(tl.int64) * gcap + pos, offs,
                     mask=(gt != 0) & (pos < gcap))
        else:
            take, pos, _, _ = _take(key, m, t, k - g_total, gt_before, tl.sum(eqs, 0))
            tl.store(out_ptr + tok * out_stride + pos, tl.where(offs < vis, offs, -1),
                     mask=take)


@triton.jit
def _filter_select_kernel(cnt_ptr, src_ptr, gt_ptr, out_ptr, vis_ptr, tile_tok_ptr,
                          tile_cnt_ptr, tile_base, slot_base, N, k, nch, gcap, out_stride,
                          NCH_PAD: tl.constexpr, STEP: tl.constexpr, TILE: tl.constexpr,
                          HAS_TILES: tl.constexpr, CLIP: tl.constexpr, CH: tl.constexpr):
    """_select_filtered's slots with G >= k keys above t: the top-k of the G listed rows (a
    radix select over them; every key >= the k-th largest is listed), rows ascending, as
    _select_kernel writes it. A slot with fewer is done already. CLIP: G counted over the
    slot's _clip_width rows (chunks of CH). Grid (slots,)."""
    slot = tl.program_id(0)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                           HAS_TILES)
    n = _slot_width(None, vis_ptr, tok, ok, slot, N, k, 1, TILE, False, CLIP)
    prev = tl.arange(0, NCH_PAD)
    g_total = tl.sum(tl.load(cnt_ptr + slot * 2 * nch + prev, mask=(prev < nch) & (prev * CH < n),
                             other=0), 0)
    if ok & (g_total >= k):
        src_row = src_ptr + slot.to(tl.int64) * N
        gl = gt_ptr + slot.to(tl.int64) * gcap
        hist = tl.zeros([256], tl.int32)
        for s0 in range(0, g_total, STEP):
            j = s0 + tl.arange(0, STEP)
            m = j < g_total
            key = _load_keys(src_row, tl.load(gl + j, mask=m, other=0), m, True)
            hist += _byte_hist(key >> 8, m)
        b, above, in_bin = _threshold_of(hist, g_total, k)
        hist = tl.zeros([256], tl.int32)
        for s0 in range(0, g_total, STEP):
            j = s0 + tl.arange(0, STEP)
            m = j < g_total
            key = _load_keys(src_row, tl.load(gl + j, mask=m, other=0), m, True)
            hist += _byte_hist(key & 0xFF, m & ((key >> 8) == b))
        lo, above_lo, in_lo = _threshold_of(hist, in_bin, k - above)
        u = b * 256 + lo
        need = k - above - above_lo
        vis = tl.load(vis_ptr + tok)
        gt_seen = 0
        eq_seen = 0
        for s0 in range(0, g_total, STEP):
            j = s0 + tl.arange(0, STEP)
            m = j < g_total
            offs = tl.load(gl + j, mask=m, other=0)
            key = _load_keys(src_row, offs, m, True)
            take, pos, gt, eq = _take(key, m, u, need, gt_seen, eq_seen)
            tl.store(out_ptr + tok * out_stride + pos, tl.where(offs < vis, offs, -1),
                     mask=take)
            gt_seen += gt
            eq_seen += eq


def _select(src, k: int, out, visible, tiles, tile_base: int, slot_base: int, slots: int,
            n: int, from_scores: bool, mask_out: bool, compact=None, ch: int | None = None,
            clip: bool = False, unit: int = 1, hist=None) -> None:
    """Radix top-k of ``slots`` rows of ``src`` [slots, n] into ``out`` (see _select_kernel).
    compact: None, or (row counts [owners] int32, block lists [owners, W] int32, block
    size): src holds each slot's candidate rows compactly (see _compact_candidates). clip:
    each slot's first _clip_width entries only, ``unit`` rows an entry (a prefill's). hist:
    zeroed int32 [2, slots, 256] (None: made here; not used where _one_program holds)."""
    dev = src.device
    tile_tok, tile_cnt, tile = tiles
    if _one_program(n, compact is not None):
        _select_one_kernel[(slots,)](
            src, out, visible, tile_tok, tile_cnt, tile_base, slot_base, n, k, out.stride(0), 0,
            CH=_one_program_ch(n), TILE=tile, HAS_TILES=tile_tok is not None,
            FROM_SCORES=from_scores, MASK_OUT=mask_out, CLIP=clip, UNIT=unit, BLOCKS=False,
            DIGIT=SEARCH_DIGIT_BITS, num_warps=_one_program_warps(n))
        return
    ch = SELECT_CHUNK if ch is None else ch  # rows per program
    if hist is None:
        hist = torch.zeros(2, slots, 256, dtype=torch.int32, device=dev)
    nch = cdiv(n, ch)
    cnt = torch.empty(slots, 2, nch, dtype=torch.int32, device=dev)
    nvalid, blocks, bs = compact if compact is not None else (None, None, 1)
    common = (tile_tok, tile_cnt, tile_base, slot_base, n, k)
    meta = dict(CH=ch, TILE=tile, HAS_TILES=tile_tok is not None,
                FROM_SCORES=from_scores, COMPACT=compact is not None, CLIP=clip, UNIT=unit)
    grid = (slots, nch)
    for low in (False, True):
        _hist_kernel[grid](src, hist[0], hist[1], nvalid, visible, *common, LOW=low, **meta,
                           num_warps=4)
    _count_kernel[grid](src, hist[0], hist[1], cnt, nvalid, visible, *common, nch, 0, **meta,
                        FILTER=False, FB=1, num_warps=4)
    _select_kernel[grid](src, hist[0], hist[1], cnt, out, visible, nvalid, blocks, *common, nch,
                         out.stride(0), blocks.stride(0) if blocks is not None else 0,
                         NCH_PAD=next_pow2(nch), MASK_OUT=mask_out,
                         BLOCK_SIZE=bs, **meta, num_warps=4)


def _candidate_blocks(scores, kb: int, keep, visible, tiles, tile_base: int, slot_base: int,
                      slots: int, n_rows: int, block_size: int, clip: bool, hist) -> None:
    """The candidate source's kept blocks (keep: uint8 [T, nblk] flags) from bf16 scores
    [slots, n_rows]: the top-kb blocks by their largest score, the newest visible block
    pinned. Block keys (_block_key_kernel) then _select's passes over them, or where the
    blocks are few (_one_program) both in one launch. hist: as _select's."""
    tile_tok, tile, nblk = tiles[0], tiles[2], cdiv(n_rows, block_size)
    if _one_program(nblk, False):
        _select_one_kernel[(slots,)](
            scores, keep, visible, tile_tok, tiles[1], tile_base, slot_base, nblk, kb,
            keep.stride(0), n_rows, CH=_one_program_ch(nblk), TILE=tile,
            HAS_TILES=tile_tok is not None, FROM_SCORES=False, MASK_OUT=True, CLIP=clip,
            UNIT=block_size, BLOCKS=True, DIGIT=SEARCH_DIGIT_BITS,
            num_warps=_one_program_warps(nblk))
        return
    bkeys = torch.empty(slots, nblk, dtype=torch.int32, device=scores.device)
    _block_key_kernel[(slots, cdiv(nblk, BLOCK_KEYS))](
        scores, bkeys, visible, tile_tok, tiles[1], tile_base, slot_base, n_rows, nblk, kb,
        BLOCK_SIZE=block_size, BS_PAD=next_pow2(block_size), BB=BLOCK_KEYS,
        TILE=tile, HAS_TILES=tile_tok is not None, PIN=True, CLIP=clip, num_warps=4)
    _select(bkeys, kb, keep, visible, tiles, tile_base, slot_base, slots, nblk, False, True,
            clip=clip, unit=block_size, hist=hist)


def _one_program(n: int, compact: bool) -> bool:
    """Whether _select runs a source of n entries a slot as _select_one_kernel."""
    return not compact and n <= SELECT_ONE_PROGRAM


def _one_program_ch(n: int) -> int:
    """_select_one_kernel's CH for a source of n entries a slot."""
    return next_pow2(n)


def _one_program_warps(n: int) -> int:
    """Warps of _select_one_kernel for n entries a slot: 4 below 2048, 8 from there. H100,
    one call of 1-256 slots, us at 4 / 8 / 16 warps: 2048 rows 6.0 / 5.8 / 6.6 (one slot),
    4096 rows 8.3 / 7.9 / 8.9, 8192 rows 22.5 / 11.9 / 13.2, 8192 candidate blocks 49.7 /
    42.3 / 41.5 (sm_90a, Triton 3.6: no spill; 128 registers at 8192 entries and 8 warps)."""
    return 4 if _one_program_ch(n) < 2048 else 8


def _filters(slots: int, n: int, k: int) -> bool:
    """Whether a top-k of ``slots`` queries over n rows each runs through _select_filtered.
    H200, the whole indexer in a CUDA graph at V4.1-Flash's top-512, us with / without the
    filter: 32 x 64K rows 175 / 179, 64 x 32K 178 / 179, 128 x 32K 313 / 331, the candidate
    source 64 x 64K 338 / 356, 1 x 1M 103 / 104, 4 x 1M 318 / 330. With a 4096-row
    selection step it lost up to 10% at 8-32 queries (one program a query in its last step,
    latency bound), so the rule keeps small calls on the radix select."""
    return (slots * n >= FILTER_MIN_SCORES and n >= FILTER_MIN_ROWS
            and cdiv(n, FILTER_BLOCK) >= k)


def _filter_bytes(n: int, k: int) -> int:
    """Bytes a query slot's filter holds: block maxima and the list of rows above t."""
    return 4 * (cdiv(n, FILTER_BLOCK) + k * FILTER_BLOCK)


def _select_filtered(src, k: int, out, visible, tiles, tile_base: int, slot_base: int,
                     slots: int, n: int, clip: bool = False, hist=None) -> None:
    """_select's top-k of bf16 scores (src int16 [slots, n], no compact source) into
    ``out``, the same rows, through a filter (for n >> k; _filters). t = the k-th largest of
    the maxima of FILTER_BLOCK-row blocks (a radix select over n / FILTER_BLOCK keys). At
    least k blocks hold a key >= t, so the k-th largest key s_k >= t; fewer than k blocks
    hold a key above t, so at most G <= (k - 1) * FILTER_BLOCK keys are above t. With G < k,
    s_k = t and one pass writes the selection as _select_kernel does (_count_kernel, then
    _filter_write_kernel); else that pass lists the G rows above t, which hold every key >=
    s_k, and one program per slot selects from them (_filter_select_kernel). Ties go to the
    lower row as in _select. clip: as _select's, for rows and block maxima alike. hist: as
    _select's."""
    dev = src.device
    tile_tok, tile_cnt, tile = tiles
    has_tiles = tile_tok is not None
    fb = FILTER_BLOCK
    nb = cdiv(n, fb)
    gcap = k * fb
    bkeys = torch.empty(slots, nb, dtype=torch.int32, device=dev)
    _block_key_kernel[(slots, cdiv(nb, BLOCK_KEYS))](
        src, bkeys, visible, tile_tok, tile_cnt, tile_base, slot_base, n, nb, k,
        BLOCK_SIZE=fb, BS_PAD=next_pow2(fb), BB=BLOCK_KEYS, TILE=tile,
        HAS_TILES=has_tiles, PIN=False, CLIP=clip, num_warps=4)
    if hist is None:
        hist = torch.zeros(2, slots, 256, dtype=torch.int32, device=dev)
    ch = SELECT_CHUNK
    for low in (False, True):
        _hist_kernel[(slots, cdiv(nb, ch))](
            bkeys, hist[0], hist[1], None, visible, tile_tok, tile_cnt, tile_base, slot_base,
            nb, k, LOW=low, CH=ch, TILE=tile, HAS_TILES=has_tiles, FROM_SCORES=False,
            COMPACT=False, CLIP=clip, UNIT=fb, num_warps=4)
    ch = FILTER_CHUNK
    nch = cdiv(n, ch)
    nch_pad = next_pow2(nch)
    cnt = torch.empty(slots, 2, nch, dtype=torch.int32, device=dev)
    gt = torch.empty(slots, gcap, dtype=torch.int32, device=dev)
    common = (tile_tok, tile_cnt, tile_base, slot_base, n, k, nch)
    meta = dict(TILE=tile, HAS_TILES=has_tiles, CLIP=clip)
    _count_kernel[(slots, nch)](src, hist[0], hist[1], cnt, None, visible, *common, nb, CH=ch,
                                **meta, FROM_SCORES=True, COMPACT=False, FILTER=True, UNIT=1,
                                FB=fb, num_warps=4)
    _filter_write_kernel[(slots, nch)](src, hist[0], hist[1], cnt, gt, out, visible, *common,
                                       nb, gcap, out.stride(0), CH=ch, NCH_PAD=nch_pad, **meta,
                                       FB=fb, num_warps=4)
    _filter_select_kernel[(slots,)](cnt, src, gt, out, visible, *common, gcap, out.stride(0),
                                    NCH_PAD=nch_pad, STEP=FILTER_STEP, **meta, CH=ch,
                                    num_warps=4)


def _query_tiles(token_groups, tile: int, device):
    """Tiles of up to ``tile`` consecutive tokens of one sequence, as (first token [n] int64,
    count [n] int32), from the step's token groups (device ops only)."""
    firsts, counts = [], []
    for m, tokens in token_groups:
        first = tokens.view(-1, m)[:, 0].to(device)
        offs = torch.arange(0, m, tile, device=device)
        firsts.append((first[:, None] + offs).flatten())
        counts.append((m - offs).clamp(max=tile).to(torch.int32).expand(first.numel(), -1)
                      .flatten())
    return torch.cat(firsts), torch.cat(counts)


def _score_tiles_per_prog(tiles: int, row_tiles: int, sms: int) -> int:
    """Row tiles per scoring program over whole rows (not compact) for ``tiles`` query tiles
    of ``row_tiles`` row tiles each: SCORE_TILES_PER_PROGRAM (each program loads its queries
    once for all of them), halved while that leaves fewer than SCORE_PROGRAMS_PER_SM programs
    an SM (a decode of one query over 2048 rows: 2 programs of 8 tiles, each a serial chain;
    at 1 tile a program, 16). A row's score is the same at any count."""
    t = SCORE_TILES_PER_PROGRAM
    while t > 1 and tiles * cdiv(row_tiles, t) < SCORE_PROGRAMS_PER_SM * sms:
        t //= 2
    return t


def _compact_tiles_per_prog(owners: int) -> int:
    """Row tiles per scoring program over candidate lists: SCORE_TILES_PER_PROGRAM once a
    chunk has enough list owners to fill the GPU, fewer (the lists spread over more
    programs) below COMPACT_OWNERS_PER_TILE owners per tile."""
    n = max(1, owners // COMPACT_OWNERS_PER_TILE)
    return max(1, min(SCORE_TILES_PER_PROGRAM, 1 << (n.bit_length() - 1)))


def _compact_candidates(cand, nblk: int, first: int, n_rows: int, block_size: int, owners: int,
                        tiles, tile_base: int, slot_base: int):
    """A candidate consumer's lists, one per query tile of the chunk (device ops only): the
    blocks that one of the tile's queries keeps, or that hold a row below k (the first
    ``first`` blocks), ascending, as (blocks [owners, nblk] int32, row counts [owners]
    int32). Every row the reference can select lies in its query's list: the kept rows, and
    the lowest-numbered -inf rows that fill a top-k with fewer than k finite scores (all
    below k); listing rows in ascending order keeps ties to the lower row."""
    dev = cand.device
    tile_tok, tile_cnt, tile = tiles
    nlch = cdiv(nblk, LIST_CHUNK)
    lcnt = torch.empty(owners, nlch, dtype=torch.int32, device=dev)
    blocks = torch.empty(owners, nblk, dtype=torch.int32, device=dev)
    nvalid = torch.empty(owners, dtype=torch.int32, device=dev)
    common = (tile_tok, tile_cnt, tile_base, slot_base, nblk, first, cand.stride(0), nlch)
    meta = dict(LCH=LIST_CHUNK, TILE=tile, HAS_TILES=tile_tok is not None)
    _list_count_kernel[(owners, nlch)](cand, lcnt, *common, **meta, num_warps=4)
    _list_write_kernel[(owners, nlch)](cand, lcnt, blocks, nvalid, *common, n_rows,
                                       blocks.stride(0), NLCH_PAD=next_pow2(nlch),
                                       BLOCK_SIZE=block_size, **meta, num_warps=4)
    return blocks, nvalid


def index_topk(q_index: torch.Tensor, head_weights: torch.Tensor, key_pool: torch.Tensor,
               block_table: torch.Tensor, token_row: torch.Tensor, visible: torch.Tensor,
               n_rows: int, topk: int, token_groups: list[tuple[int, torch.Tensor]],
               candidates: torch.Tensor | None = None, candidate_topk: int | None = None,
               block_size: int = 8, score_budget: int = 1 << 30, reduce=None,
               head_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """reference.index_topk in Triton (same arguments, same results; module docstring; the
    head weights are scaled as the scoring kernel loads them).

    score_budget: bytes of bf16 scores held at once, with a consumer's lists and the filter's
    buffers (a prefill longer than that runs in query chunks; the results do not depend on
    it). reduce: called on each chunk's bf16 scores
    [queries, n_rows] (tensor parallelism's all-reduce) before candidates and top-k."""
    t_all, dev = q_index.shape[0], q_index.device
    require(q_index.dim() == 3 and q_index.dtype == torch.bfloat16,
            f"q_index must be a bf16 [T, I, d] tensor, got {q_index.dtype} {tuple(q_index.shape)}")
    _, heads, d = q_index.shape
    require(d in (32, 64, 128), f"index_head_dim must be 32, 64 or 128 for the kernel, got {d}")
    require(key_pool.dtype == torch.uint8 and key_pool.dim() == 3
            and key_pool.shape[2] == index_key_bytes(d) and key_pool.is_contiguous(),
            f"key_pool must be a contiguous uint8 [P, page_rows, {index_key_bytes(d)}] tensor, "
            f"got {key_pool.dtype} {tuple(key_pool.shape)}")
    require(head_weights.shape == (t_all, heads),
            f"head_weights must be [T={t_all}, I={heads}], got {tuple(head_weights.shape)}")
    for name, t in (("token_row", token_row), ("visible", visible)):
        require(t.shape == (t_all,) and not t.is_floating_point(),
                f"{name} must be an integer [T={t_all}] tensor, got {t.dtype} {tuple(t.shape)}")
    require(block_table.dim() == 2 and not block_table.is_floating_point()
            and block_table.shape[1] * key_pool.shape[1] >= n_rows,
            f"block_table must be an integer [B, pages] tensor whose pages of "
            f"{key_pool.shape[1]} rows hold n_rows={n_rows}, got {block_table.dtype} "
            f"{tuple(block_table.shape)}")
    require(topk >= 1 and block_size >= 1,
            f"topk and block_size must be >= 1, got {topk} and {block_size}")
    check_device(q_index, head_weights, key_pool, block_table, token_row, visible)
    k = min(topk, n_rows)
    selected = torch.empty(t_all, k, dtype=torch.int32, device=dev)
    nblk = cdiv(n_rows, block_size)
    keep = torch.empty(t_all, nblk, dtype=torch.bool, device=dev) \
        if candidate_topk is not None else None
    if n_rows == 0 or t_all == 0:
        return selected, keep
    words = index_key_bytes(d) % 4 == 0  # rows of whole 32-bit words (68 B at d = 128)
    q = q_index.contiguous()
    w = head_weights.contiguous()
    table = block_table.contiguous()
    vis = visible.contiguous()
    rows = token_row.contiguous()
    cand = None
    if candidates is not None:
        require(candidates.dim() == 2 and candidates.shape[0] == t_all
                and candidates.shape[1] * block_size >= n_rows,
                f"candidates must be [T={t_all}, >= {nblk}] blocks, got "
                f"{tuple(candidates.shape)}")
        cand = candidates.contiguous().view(torch.uint8)
    prefill = any(m > 1 for m, _ in token_groups)
    # A prefill's queries see causal prefixes of the rows: scoring and selection stop at each
    # query's visible rows (and k) instead of the widest query's
    clip = prefill
    tile = PREFILL_TILE if prefill else 1
    if prefill:
        tile_tok, tile_cnt = _query_tiles(token_groups, tile, dev)
        n_tiles = tile_tok.numel()
    else:
        tile_tok = tile_cnt = None
        n_tiles = t_all
    # A consumer (not also the source) scores and selects over its candidate list only
    compact = cand is not None and keep is None and n_rows > COMPACT_MIN_ROWS
    width = nblk * block_size if compact else n_rows  # score buffer columns
    per_tile = tile * width * 2 + (nblk * 4 if compact else 0)
    filtered = not compact and _filters(n_tiles * tile, width, k)
    if filtered:
        per_tile += tile * _filter_bytes(width, k)
    chunk_tiles = max(1, min(n_tiles, score_budget // per_tile))
    i_pad = max(next_pow2(heads), 16 // tile)
    interpret = interpreting()
    rows_per_tile = PREFILL_SCORE_ROWS if prefill else SCORE_ROWS
    sms = sm_count(dev)
    tiles = (tile_tok, tile_cnt, tile)
    for t0 in range(0, n_tiles, chunk_tiles):
        c = min(chunk_tiles, n_tiles - t0)
        slots = c * tile
        tile_base, slot_base = (t0, 0) if prefill else (0, t0)
        tiles_per_prog = _compact_tiles_per_prog(c) if compact else _score_tiles_per_prog(
            c, cdiv(width, rows_per_tile), sms)
        lists = _compact_candidates(cand, nblk, cdiv(k, block_size), n_rows, block_size, c,
                                    tiles, tile_base, slot_base) if compact else None
        scores = torch.empty(slots, width, dtype=torch.int16, device=dev)
        # the histograms of the selections that need them (the candidate blocks', the rows'),
        # zeroed by the scoring
        hist_blocks = keep is not None and not _one_program(nblk, False)
        hist_rows = filtered or not _one_program(width, compact)
        nz = hist_blocks + hist_rows
        hist = torch.empty(nz, 2, slots, 256, dtype=torch.int32, device=dev) if nz else None
        row_progs = cdiv(width, rows_per_tile * tiles_per_prog)
        if compact:
            row_progs = min(row_progs, cdiv(COMPACT_PROGRAMS, c))
        _score_kernel[(c, row_progs)](
            q, w, key_pool, table, vis, rows, cand, *(lists or (None, None)), scores, hist,
            tile_tok, tile_cnt, tile_base, slot_base, width, k, float(head_scale), slots,
            table.stride(0),
            cand.shape[1] if cand is not None else 0, nblk if compact else 0, tiles_per_prog,
            PAGE_ROWS=key_pool.shape[1], I=heads, I_PAD=i_pad, D=d, TILE=tile, BN=rows_per_tile,
            BLOCK_SIZE=block_size, WORDS=words, HAS_TILES=prefill, HAS_KEEP=cand is not None,
            COMPACT=compact, CLIP=clip and not compact, NZ=nz, INTERPRET=interpret,
            num_warps=PREFILL_WARPS if prefill else SCORE_WARPS)
        if reduce is not None:
            scores = reduce(scores.view(torch.bfloat16)).contiguous().view(torch.int16)
        if keep is not None:
            _candidate_blocks(scores, min(candidate_topk, nblk), keep.view(torch.uint8), vis,
                              tiles, tile_base, slot_base, slots, n_rows, block_size, clip,
                              hist[0] if hist_blocks else None)
        if filtered:
            _select_filtered(scores, k, selected, vis, tiles, tile_base, slot_base, slots, width,
                             clip=clip, hist=hist[-1])  # filtered: hist_rows
        else:
            _select(scores, k, selected, vis, tiles, tile_base, slot_base, slots, width, True,
                    False, compact=(lists[1], lists[0], block_size) if compact else None,
                    ch=COMPACT_SELECT_CHUNK if compact else SELECT_CHUNK, clip=clip,
                    hist=hist[-1] if hist_rows else None)
    return selected, keep
