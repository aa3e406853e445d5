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
   (as 32-bit words where rows are 4-byte aligned: 68 B at d = 128) and decoded in registers,
   8 nibbles per word, to f16 codes worth e2m1 * 2^-6 (an e4m3 re-encoding and the hardware
   e4m3 -> f16 conversion). Per 32-element scale block the dot of key codes and query codes
   (the query split exactly into f16 codes times a power of two) is exact in fp32; it is
   scaled by both powers of two and the blocks are summed in fp32, which is the reference's
   exact bf16 product sum. Per head the dot is rounded to bf16, relu'd, multiplied by its
   weight and rounded to bf16, then the heads are summed in fp32 and rounded to bf16: the
   reference's rounding points. Rows a query cannot see, and for a candidate consumer rows
   outside its kept blocks, are -inf and their key bytes are never loaded; a tile with
   nothing to score loads nothing. Scores go to a bf16 buffer [queries, rows] (a consumer's:
   [queries, list positions], row = list[p // block_size] * block_size + p % block_size).
2. Candidate source only: ``_block_key_kernel`` takes each block's maximum (the newest
   visible block pinned to +inf) as an ordered 16-bit key per block.
3. Exact top-k by radix select on the ordered 16-bit keys of the bf16 scores (``_order_key``:
   larger key = larger score, -0 = +0, every NaN largest, as torch.sort orders them), rows
   split across programs: ``_hist_kernel`` (twice: the high byte, then the low byte inside
   the high byte's threshold bin; atomic 256-bin histograms) fixes the k-th key u and how many
   rows equal to u are needed; ``_count_kernel`` counts rows above and equal to u per row
   chunk; ``_select_kernel`` writes the selection in ascending row order: every row above u and
   the lowest-numbered rows equal to u, i.e. higher score first, ties to the lower row (SPEC
   §0.2). For top-k rows past a query's ``visible`` become -1 (a consumer's list positions
   mapped back to rows first); for candidate blocks the kept mask is written (a block whose
   maximum is -inf is never kept).

The score buffer is bounded by ``score_budget`` bytes: longer prefills run in query chunks.
``reduce`` (tensor parallelism) gets each chunk's score buffer, a consumer's compact one too:
every rank lists the same rows (the kept flags are the same on every rank), and positions
past a tile's count hold no score. A call that is both source and consumer scores every row.
Under TRITON_INTERPRET the dot runs in fp32 on the same exact values (the interpreter has no
inline asm and misreads 16-bit dot operands) and gives the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.packing import index_key_bytes
from ..common.triton import (check_device, e4m3_of_e2m1, e4m3_to_fp32, interpreting,
                             require, round_bf16)

PREFILL_TILE = 4  # queries of one sequence per scoring program (they share the key loads)
SCORE_ROWS = 128  # rows per scoring tile (decode)
PREFILL_SCORE_ROWS = 64  # with PREFILL_TILE queries (H200, prefill 8K: 128-row tiles ran 2x slower)
SCORE_TILES_PER_PROGRAM = 8  # row tiles per scoring program (the query is loaded once)
SCORE_WARPS = 4  # warps per scoring program (H200: 8 measured slower)
SELECT_CHUNK = 4096  # rows per selection program
BLOCK_KEYS = 128  # candidate blocks per block-key program
LIST_CHUNK = 4096  # candidate blocks per list-compaction program
# A candidate consumer scores over compact lists only past this many rows (below it, at
# V4.1-Flash's 2048 blocks x 8 rows, a consumer can keep every block: H200, 4K rows, walking
# every row took 53 us at b=64, the lists 56-65 us)
COMPACT_MIN_ROWS = 16384
COMPACT_OWNERS_PER_TILE = 8  # candidate lists per row tile of a scoring program
COMPACT_PROGRAMS = 2048  # scoring programs over the lists of a chunk (at least one per list)
COMPACT_SELECT_CHUNK = 1024  # list positions per selection program

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
def _slot_width(nvalid_ptr, slot, N, TILE: tl.constexpr, COMPACT: tl.constexpr):
    """Entries of a query slot's selection source: N, or for a compact source its list
    owner's (slot // TILE) candidate row count."""
    if COMPACT:
        return tl.load(nvalid_ptr + slot // TILE)
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


# A word of 8 e2m1 nibbles ($8, element t in bits 4t..4t+3) -> 8 f16 ($0..$7) worth the e2m1
# values * 2^-6, exactly: each nibble s|e1 e0|m becomes the e4m3 byte s|0 0 e1 e0|m 0 0
# (e4m3_of_e2m1), bytes put in element order, then the hardware e4m3x2 -> f16x2 conversion.
_NIBBLES_F16_ASM = tl.constexpr(
    "{ .reg .b32 t, u, l, h, a, b, x; .reg .b16 e01, e23, e45, e67;"
    " shl.b32 t, $8, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 u, $8, 4; and.b32 u, u, 0x80808080;"
    " or.b32 l, t, u; shr.b32 t, $8, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 u, $8, 0x80808080;"
    " or.b32 h, t, u; prmt.b32 a, l, h, 0x5140; prmt.b32 b, l, h, 0x7362;"
    " mov.b32 {e01, e23}, a; mov.b32 {e45, e67}, b;"
    + "".join(f" cvt.rn.f16x2.e4m3x2 x, {src}; mov.b32 {{{d0}, {d1}}}, x;"
              for src, d0, d1 in (("e01", "$0", "$1"), ("e23", "$2", "$3"),
                                  ("e45", "$4", "$5"), ("e67", "$6", "$7"))) + " }")


@triton.jit
def _code_value(nib, INTERPRET: tl.constexpr):
    """e2m1 nibbles (uint8) -> their values * 2^-6 as dot operands (f16; fp32 under the
    interpreter)."""
    v = e4m3_to_fp32(e4m3_of_e2m1(nib))
    if INTERPRET:
        return v
    else:
        return v.to(tl.float16)


@triton.jit
def _key_raw(pool_ptr, base, live, blk: tl.constexpr, D: tl.constexpr, WORDS: tl.constexpr):
    """Issue the loads of scale block ``blk`` (32 elements) of the key rows at byte offsets
    ``base`` [BN]: (codes: 4 int32 words [BN, 4] (WORDS: 4-byte aligned rows) or 16 bytes
    [BN, 16], element 2j in the low nibble; the ue8m0 scale byte [BN] as int32)."""
    if WORDS:
        wptr = pool_ptr.to(tl.pointer_type(tl.int32)) + base[:, None] // 4
        raw = tl.load(wptr + blk * 4 + tl.arange(0, 4)[None, :], mask=live[:, None], other=0)
    else:
        raw = tl.load(pool_ptr + base[:, None] + blk * 16 + tl.arange(0, 16)[None, :],
                      mask=live[:, None], other=0)
    e = tl.load(pool_ptr + base + D // 2 + blk, mask=live, other=0).to(tl.int32)
    return raw, e


@triton.jit
def _key_block(raw, e, BN: tl.constexpr, WORDS: tl.constexpr, INTERPRET: tl.constexpr):
    """_key_raw's loads -> (codes [BN, 32] worth e2m1 * 2^-6 in element order, the block's
    scale * 2^6 [BN] fp32). Words are decoded 8 nibbles at a time."""
    if WORDS:
        if INTERPRET:
            e0, e1, e2, e3, e4, e5, e6, e7 = (
                _code_value(((raw >> (4 * t)) & 15).to(tl.uint8), INTERPRET)
                for t in tl.static_range(8))
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
                _NIBBLES_F16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [raw],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        # nibble t of word w: element 8w + t
        v = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)),
                    tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    else:
        v = tl.join(_code_value(raw & 15, INTERPRET), _code_value(raw >> 4, INTERPRET))
    scale = (e << 23).to(tl.float32, bitcast=True) * 64.0  # ue8m0 as the reference: 0 -> 0
    return tl.reshape(v, (BN, 32)), scale


@triton.jit
def _tile_fetch(pool_ptr, bt_ptr, keep_ptr, list_ptr, row, tok0, offs_m, m_ok, vis, g0, g_end,
                bt_stride, page_rows, keep_stride, D: tl.constexpr, BN: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, WORDS: tl.constexpr, HAS_KEEP: tl.constexpr,
                COMPACT: tl.constexpr):
    """The loads of one tile of positions g0 .. g0 + BN - 1 (none at or past ``g_end``): the
    rows themselves, or for a compact tile the rows its positions stand for in the tile's
    block list (list_ptr); which (position, query) pairs are scored, which rows are read, the
    raw key blocks."""
    NB: tl.constexpr = D // 32
    B1: tl.constexpr = 1 if NB > 1 else 0  # blocks past the row's: reload block 0 (unused)
    B2: tl.constexpr = 2 if NB > 2 else 0
    B3: tl.constexpr = 3 if NB > 2 else 0
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
    r0, e0 = _key_raw(pool_ptr, base, live, 0, D, WORDS)
    r1, e1 = _key_raw(pool_ptr, base, live, B1, D, WORDS)
    r2, e2 = _key_raw(pool_ptr, base, live, B2, D, WORDS)
    r3, e3 = _key_raw(pool_ptr, base, live, B3, D, WORDS)
    return seen, need, r0, r1, r2, r3, e0, e1, e2, e3


@triton.jit
def _q_block(q_ptr, q_off, r_ok, blk: tl.constexpr, INTERPRET: tl.constexpr):
    """Scale block ``blk`` of the index queries as the dot's right operand: (codes [32, rows],
    scale [rows]) with q = codes * scale exactly: the scale is the power of two at or below
    the block's amax, so the fp4 values divide exactly into f16."""
    kk = tl.arange(0, 32)
    v = tl.load(q_ptr + q_off[None, :] + blk * 32 + kk[:, None], mask=r_ok[None, :],
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), 0)
    s = (amax.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    s = tl.where(s == 0.0, 1.0, s)
    c = v / s[None, :]
    if not INTERPRET:
        c = c.to(tl.float16)
    return c, s


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
                  nvalid_ptr, out_ptr, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, N,
                  bt_stride, page_rows, keep_stride, list_stride, tiles_per_prog,
                  I: tl.constexpr, I_PAD: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                  BN: tl.constexpr, BLOCK_SIZE: tl.constexpr, WORDS: tl.constexpr,
                  HAS_TILES: tl.constexpr, HAS_KEEP: tl.constexpr, COMPACT: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """q: [T, I, D] bf16; w: [T, I] bf16; pool: uint8 key rows (D/2 bytes of e2m1 pairs, then
    D/32 ue8m0 bytes); bt: [B, pages] int64; vis, row: [T] int64; keep: uint8 [T,
    keep_stride] (HAS_KEEP); out: int16 [slots, N] bf16 bits, slot = the query's place in
    this call's chunk. COMPACT: out's position p of query tile t stands for row
    list[t, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE, for p below nvalid[t] (list:
    int32 [tiles, list_stride]; positions past nvalid[t] are not written), and program j of
    a tile scores its list's runs of tiles_per_prog row tiles j, j + programs, ... (one past
    them loads nothing). Grid (chunk tiles, cdiv(N, BN * tiles_per_prog), over lists at most
    COMPACT_PROGRAMS / tiles of them).

    Per 32-element scale block the dot of the codes is exact in fp32 (f16 operands, e2m1
    products); it is scaled by the key's and the query's powers of two and summed over the
    blocks in fp32, as the reference's matmul sums the exact bf16 products."""
    NB: tl.constexpr = D // 32
    R: tl.constexpr = TILE * I_PAD  # (token, head) columns of the dot
    tile = tl.program_id(0)
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
    offs_r = tl.arange(0, R)
    r_tok = offs_r // I_PAD
    r_head = offs_r % I_PAD
    r_ok = (r_tok < live) & (r_head < I)
    q_off = (tok0 + r_tok) * (I * D) + r_head * D
    qc0, qs0 = _q_block(q_ptr, q_off, r_ok, 0, INTERPRET)
    if NB > 1:
        qc1, qs1 = _q_block(q_ptr, q_off, r_ok, 1, INTERPRET)
    if NB > 2:
        qc2, qs2 = _q_block(q_ptr, q_off, r_ok, 2, INTERPRET)
        qc3, qs3 = _q_block(q_ptr, q_off, r_ok, 3, INTERPRET)
    wv = tl.load(w_ptr + (tok0 + r_tok) * I + r_head, mask=r_ok, other=0.0).to(tl.float32)
    out_cols = out_ptr + (tile.to(tl.int64) * TILE + offs_m.to(tl.int64))[None, :] * N
    g_first = tl.program_id(1) * tiles_per_prog * BN
    if COMPACT:
        g_end = n
    else:
        g_end = tl.minimum(N, g_first + tiles_per_prog * BN)  # this program's rows end there
    seen, need, r0, r1, r2, r3, e0, e1, e2, e3 = _tile_fetch(
        pool_ptr, bt_ptr, keep_ptr, lst, row, tok0, offs_m, m_ok, vis, g_first, g_end,
        bt_stride, page_rows, keep_stride, D, BN, BLOCK_SIZE, WORDS, HAS_KEEP, COMPACT)
    for it in range(n_it):
        # positions (rows unless COMPACT)
        offs_g = _tile_start(it, g_first, tiles_per_prog, BN, COMPACT) + tl.arange(0, BN)
        # the next tile's loads go out before this tile's arithmetic (software pipelining)
        n_seen, n_need, n0, n1, n2, n3, f0, f1, f2, f3 = _tile_fetch(
            pool_ptr, bt_ptr, keep_ptr, lst, row, tok0, offs_m, m_ok, vis,
            _tile_start(it + 1, g_first, tiles_per_prog, BN, COMPACT), g_end,
            bt_stride, page_rows, keep_stride, D, BN, BLOCK_SIZE, WORDS, HAS_KEEP, COMPACT)
        store_ok = (offs_g < n)[:, None] & m_ok[None, :]
        if tl.max(need.to(tl.int32), 0) == 0:
            tl.store(out_cols + offs_g[:, None], tl.full([BN, TILE], 0xFF80, tl.int32)
                     .to(tl.int16), mask=store_ok)  # -inf
        else:
            kc, ks = _key_block(r0, e0, BN, WORDS, INTERPRET)
            acc = tl.dot(kc, qc0) * (ks[:, None] * qs0[None, :])
            if NB > 1:
                kc, ks = _key_block(r1, e1, BN, WORDS, INTERPRET)
                acc += tl.dot(kc, qc1) * (ks[:, None] * qs1[None, :])
            if NB > 2:
                kc, ks = _key_block(r2, e2, BN, WORDS, INTERPRET)
                acc += tl.dot(kc, qc2) * (ks[:, None] * qs2[None, :])
                kc, ks = _key_block(r3, e3, BN, WORDS, INTERPRET)
                acc += tl.dot(kc, qc3) * (ks[:, None] * qs3[None, :])
            s = round_bf16(acc, INTERPRET)  # the per-head bf16 dot, [BN, R]
            s = tl.where(s < 0, 0.0, s)  # relu (NaN kept)
            prod = round_bf16(s * wv[None, :], INTERPRET)
            score = round_bf16(tl.sum(tl.reshape(prod, [BN, TILE, I_PAD]), 2), INTERPRET)
            score = tl.where(seen, score, float("-inf"))
            bits = (score.to(tl.uint32, bitcast=True) >> 16).to(tl.int32)
            tl.store(out_cols + offs_g[:, None], bits.to(tl.int16), mask=store_ok)
        seen, need, r0, r1, r2, r3, e0, e1, e2, e3 = \
            n_seen, n_need, n0, n1, n2, n3, f0, f1, f2, f3


@triton.jit
def _block_key_kernel(src_ptr, key_ptr, vis_ptr, tile_tok_ptr, tile_cnt_ptr,
                      tile_base, slot_base, N, nblk,
                      BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr, BB: tl.constexpr,
                      TILE: tl.constexpr, HAS_TILES: tl.constexpr):
    """src: int16 [slots, N] bf16 score bits; key: int32 [slots, nblk] block keys (the max key
    of the block's rows, the newest visible block KEY_PINF). Grid (slots, cdiv(nblk, BB))."""
    slot = tl.program_id(0)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                           HAS_TILES)
    if ok:
        vis = tl.load(vis_ptr + tok)
        offs_b = tl.program_id(1) * BB + tl.arange(0, BB)
        offs_e = tl.arange(0, BS_PAD)
        g = offs_b[:, None] * BLOCK_SIZE + offs_e[None, :]
        m = (offs_e[None, :] < BLOCK_SIZE) & (g < N)
        keys = _load_keys(src_ptr + slot.to(tl.int64) * N, g, m, True)
        keys = tl.where(m, keys, KEY_NINF)  # padding past N is -inf, as the reference's
        bk = tl.max(keys, 1)
        newest = tl.where(vis > 0, (vis - 1) // BLOCK_SIZE, -1)  # vis 0: none pinned
        bk = tl.where(offs_b == newest, KEY_PINF, bk)
        tl.store(key_ptr + slot.to(tl.int64) * nblk + offs_b, bk, mask=offs_b < nblk)


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
def _threshold(hist_ptr, n, k):
    """From a 256-bin histogram of n keys' bytes: the bin b holding the k-th largest, and how
    many keys lie in bins above it."""
    bins = tl.arange(0, 256)
    h = tl.load(hist_ptr + bins)
    incl = tl.cumsum(h, 0)
    b = tl.sum((incl - h <= n - k).to(tl.int32), 0) - 1
    above = n - tl.sum(tl.where(bins == b, incl, 0), 0)
    in_bin = tl.sum(tl.where(bins == b, h, 0), 0)
    return b, above, in_bin


@triton.jit
def _hist_kernel(src_ptr, hist_hi_ptr, hist_lo_ptr, nvalid_ptr, tile_tok_ptr, tile_cnt_ptr,
                 tile_base, slot_base, N, k, LOW: tl.constexpr, CH: tl.constexpr,
                 TILE: tl.constexpr, HAS_TILES: tl.constexpr, FROM_SCORES: tl.constexpr,
                 COMPACT: tl.constexpr):
    """Radix select, one level: the high bytes' histogram (LOW false) or, inside the high
    byte's threshold bin, the low bytes' (LOW true). hist_*: int32 [slots, 256], zeroed.
    src: [slots, N], of which a compact source's slot counts its first nvalid[slot // TILE]
    entries only (a chunk past them does nothing). Grid (slots, cdiv(N, CH))."""
    slot = tl.program_id(0)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                         HAS_TILES)
    n = _slot_width(nvalid_ptr, slot, N, TILE, COMPACT)
    if COMPACT:
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
        h = tl.histogram(tl.where(m, byte, 0), 256)
        h = h - tl.where(bins == 0, CH - tl.sum(m.to(tl.int32), 0), 0)  # the masked lanes
        tl.atomic_add(dst + slot * 256 + bins, h, mask=h != 0)


@triton.jit
def _cut(hist_hi_ptr, hist_lo_ptr, N, k):
    """The k-th largest key u and how many keys equal to u the selection takes."""
    b, above, in_bin = _threshold(hist_hi_ptr, N, k)
    lo, above_lo, in_lo = _threshold(hist_lo_ptr, in_bin, k - above)
    return b * 256 + lo, k - above - above_lo


@triton.jit
def _count_kernel(src_ptr, hist_hi_ptr, hist_lo_ptr, cnt_ptr, nvalid_ptr, tile_tok_ptr,
                  tile_cnt_ptr, tile_base, slot_base, N, k, nch, CH: tl.constexpr,
                  TILE: tl.constexpr, HAS_TILES: tl.constexpr, FROM_SCORES: tl.constexpr,
                  COMPACT: tl.constexpr):
    """cnt: int32 [slots, 2, nch]: per row chunk, the keys above u and equal to u (a compact
    source's chunks past its entries are left unwritten: no live chunk reads them)."""
    slot = tl.program_id(0)
    c = tl.program_id(1)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                         HAS_TILES)
    n = _slot_width(nvalid_ptr, slot, N, TILE, COMPACT)
    if COMPACT:
        ok = ok & (c * CH < n)
    if ok:
        u, need = _cut(hist_hi_ptr + slot * 256, hist_lo_ptr + slot * 256, n, k)
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
                   MASK_OUT: tl.constexpr, COMPACT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Write the selection of one row chunk, rows ascending. MASK_OUT false: out int32 [T, k]
    row numbers (-1 past the query's visible); true: out uint8 [T, N] kept flags (key above
    -inf). A compact source's position p is row list[p // BLOCK_SIZE] * BLOCK_SIZE +
    p % BLOCK_SIZE (list: int32 [owners, list_stride] ascending blocks). Grid (slots, nch)."""
    slot = tl.program_id(0)
    c = tl.program_id(1)
    tok, ok = _query_token(slot, tile_tok_ptr, tile_cnt_ptr, tile_base, slot_base, TILE,
                           HAS_TILES)
    n = _slot_width(nvalid_ptr, slot, N, TILE, COMPACT)
    if COMPACT:
        ok = ok & (c * CH < n)
    if ok:
        u, need = _cut(hist_hi_ptr + slot * 256, hist_lo_ptr + slot * 256, n, k)
        prev = tl.arange(0, NCH_PAD)
        before = prev < c
        gt_before = tl.sum(tl.load(cnt_ptr + slot * 2 * nch + prev, mask=before, other=0), 0)
        eq_before = tl.sum(tl.load(cnt_ptr + slot * 2 * nch + nch + prev, mask=before,
                                   other=0), 0)
        offs, m, key = _chunk_keys(src_ptr, slot, c, n, N, CH, FROM_SCORES)
        gt = (m & (key > u)).to(tl.int32)
        eq = (m & (key == u)).to(tl.int32)
        eq_rank = eq_before + tl.cumsum(eq, 0) - eq
        take = (gt != 0) | ((eq != 0) & (eq_rank < need))
        if MASK_OUT:
            tl.store(out_ptr + tok * out_stride + offs, (take & (key > KEY_NINF)).to(tl.uint8),
                     mask=m)
        else:
            t32 = take.to(tl.int32)
            pos = gt_before + tl.minimum(eq_before, need) + tl.cumsum(t32, 0) - t32
            vis = tl.load(vis_ptr + tok)
            if COMPACT:
                blk = tl.load(list_ptr + (slot // TILE).to(tl.int64) * list_stride
                              + offs // BLOCK_SIZE, mask=take, other=0)
                row = blk * BLOCK_SIZE + offs % BLOCK_SIZE
            else:
                row = offs
            val = tl.where(row < vis, row, -1)
            tl.store(out_ptr + tok * out_stride + pos, val, mask=take)


def _select(src, k: int, out, visible, tiles, tile_base: int, slot_base: int, slots: int,
            n: int, from_scores: bool, mask_out: bool, compact=None, ch: int | None = None
            ) -> None:
    """Radix top-k of ``slots`` rows of ``src`` [slots, n] into ``out`` (see _select_kernel).
    compact: None, or (row counts [owners] int32, block lists [owners, W] int32, block
    size): src holds each slot's candidate rows compactly (see _compact_candidates)."""
    dev = src.device
    ch = SELECT_CHUNK if ch is None else ch  # rows per program
    hist = torch.zeros(2, slots, 256, dtype=torch.int32, device=dev)
    nch = triton.cdiv(n, ch)
    cnt = torch.empty(slots, 2, nch, dtype=torch.int32, device=dev)
    tile_tok, tile_cnt, tile = tiles
    nvalid, blocks, bs = compact if compact is not None else (None, None, 1)
    common = (tile_tok, tile_cnt, tile_base, slot_base, n, k)
    meta = dict(CH=ch, TILE=tile, HAS_TILES=tile_tok is not None,
                FROM_SCORES=from_scores, COMPACT=compact is not None)
    grid = (slots, nch)
    _hist_kernel[grid](src, hist[0], hist[1], nvalid, *common, LOW=False, **meta, num_warps=4)
    _hist_kernel[grid](src, hist[0], hist[1], nvalid, *common, LOW=True, **meta, num_warps=4)
    _count_kernel[grid](src, hist[0], hist[1], cnt, nvalid, *common, nch, **meta, num_warps=4)
    _select_kernel[grid](src, hist[0], hist[1], cnt, out, visible, nvalid, blocks, *common, nch,
                         out.stride(0), blocks.stride(0) if blocks is not None else 0,
                         NCH_PAD=triton.next_power_of_2(nch), MASK_OUT=mask_out,
                         BLOCK_SIZE=bs, **meta, num_warps=4)


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
    nlch = triton.cdiv(nblk, LIST_CHUNK)
    lcnt = torch.empty(owners, nlch, dtype=torch.int32, device=dev)
    blocks = torch.empty(owners, nblk, dtype=torch.int32, device=dev)
    nvalid = torch.empty(owners, dtype=torch.int32, device=dev)
    common = (tile_tok, tile_cnt, tile_base, slot_base, nblk, first, cand.stride(0), nlch)
    meta = dict(LCH=LIST_CHUNK, TILE=tile, HAS_TILES=tile_tok is not None)
    _list_count_kernel[(owners, nlch)](cand, lcnt, *common, **meta, num_warps=4)
    _list_write_kernel[(owners, nlch)](cand, lcnt, blocks, nvalid, *common, n_rows,
                                       blocks.stride(0), NLCH_PAD=triton.next_power_of_2(nlch),
                                       BLOCK_SIZE=block_size, **meta, num_warps=4)
    return blocks, nvalid


def index_topk(q_index: torch.Tensor, head_weights: torch.Tensor, key_pool: torch.Tensor,
               block_table: torch.Tensor, token_row: torch.Tensor, visible: torch.Tensor,
               n_rows: int, topk: int, token_groups: list[tuple[int, torch.Tensor]],
               candidates: torch.Tensor | None = None, candidate_topk: int | None = None,
               block_size: int = 8, score_budget: int = 1 << 30, reduce=None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """reference.index_topk in Triton (same arguments, same results; module docstring).

    score_budget: bytes of bf16 scores held at once (a prefill longer than that runs in query
    chunks; the results do not depend on it). reduce: called on each chunk's bf16 scores
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
    check_device(q_index, head_weights, key_pool, block_table, token_row, visible)
    k = min(topk, n_rows)
    selected = torch.empty(t_all, k, dtype=torch.int32, device=dev)
    nblk = -(-n_rows // block_size)
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
    chunk_tiles = max(1, min(n_tiles, score_budget // per_tile))
    i_pad = max(triton.next_power_of_2(heads), 16 // tile)
    interpret = interpreting()
    rows_per_tile = PREFILL_SCORE_ROWS if prefill else SCORE_ROWS
    bs_pad = triton.next_power_of_2(block_size)
    tiles = (tile_tok, tile_cnt, tile)
    for t0 in range(0, n_tiles, chunk_tiles):
        c = min(chunk_tiles, n_tiles - t0)
        slots = c * tile
        tile_base, slot_base = (t0, 0) if prefill else (0, t0)
        tiles_per_prog = _compact_tiles_per_prog(c) if compact else SCORE_TILES_PER_PROGRAM
        lists = _compact_candidates(cand, nblk, -(-k // block_size), n_rows, block_size, c,
                                    tiles, tile_base, slot_base) if compact else None
        scores = torch.empty(slots, width, dtype=torch.int16, device=dev)
        row_progs = triton.cdiv(width, rows_per_tile * tiles_per_prog)
        if compact:
            row_progs = min(row_progs, triton.cdiv(COMPACT_PROGRAMS, c))
        _score_kernel[(c, row_progs)](
            q, w, key_pool, table, vis, rows, cand, *(lists or (None, None)), scores, tile_tok,
            tile_cnt, tile_base, slot_base, width, table.stride(0), key_pool.shape[1],
            cand.shape[1] if cand is not None else 0, nblk if compact else 0, tiles_per_prog,
            I=heads, I_PAD=i_pad, D=d, TILE=tile, BN=rows_per_tile, BLOCK_SIZE=block_size,
            WORDS=words, HAS_TILES=prefill, HAS_KEEP=cand is not None, COMPACT=compact,
            INTERPRET=interpret, num_warps=SCORE_WARPS)
        if reduce is not None:
            scores = reduce(scores.view(torch.bfloat16)).contiguous().view(torch.int16)
        if keep is not None:
            bkeys = torch.empty(slots, nblk, dtype=torch.int32, device=dev)
            _block_key_kernel[(slots, triton.cdiv(nblk, BLOCK_KEYS))](
                scores, bkeys, vis, tile_tok, tile_cnt, tile_base, slot_base, n_rows, nblk,
                BLOCK_SIZE=block_size, BS_PAD=bs_pad, BB=BLOCK_KEYS, TILE=tile,
                HAS_TILES=prefill, num_warps=4)
            _select(bkeys, min(candidate_topk, nblk), keep.view(torch.uint8), vis, tiles,
                    tile_base, slot_base, slots, nblk, False, True)
        _select(scores, k, selected, vis, tiles, tile_base, slot_base, slots, width, True, False,
                compact=(lists[1], lists[0], block_size) if compact else None,
                ch=COMPACT_SELECT_CHUNK if compact else SELECT_CHUNK)
    return selected, keep
