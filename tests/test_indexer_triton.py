"""Triton indexer (ops/indexer/triton.py) against the reference selection, exact index sets:
paged fp4 keys through shuffled block tables, decode and prefill query tiles, tie-heavy rows,
rows with fewer visible rows than k and none at all, unallocated pages, candidate pinning and
partial blocks, consumers reading a source's kept blocks (scored and selected over compact
lists of them: -inf rows deciding, partial last blocks, visible limits inside kept blocks, no
kept block, prefill tiles sharing a list), rows split over several scoring and selection
programs, query chunks, and key scales of every decode path (wide, tiny, spread in a row).
Runs under TRITON_INTERPRET=1 on the CPU (conftest)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv41attn.ops.common.packing import pack_index_keys
from dsv41attn.ops.common.quant import index_fp4_fake_quant
from dsv41attn.ops.indexer import reference as ref
from dsv41attn.ops.indexer import triton as tri

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough that a short row spans several scoring and selection programs."""
    monkeypatch.setattr(tri, "SCORE_ROWS", 16)
    monkeypatch.setattr(tri, "PREFILL_SCORE_ROWS", 16)
    monkeypatch.setattr(tri, "SCORE_TILES_PER_PROGRAM", 1)
    monkeypatch.setattr(tri, "SELECT_CHUNK", 16)
    monkeypatch.setattr(tri, "SELECT_ONE_PROGRAM", 0)  # the passes (the fixture below: both)
    monkeypatch.setattr(tri, "BLOCK_KEYS", 4)
    monkeypatch.setattr(tri, "LIST_CHUNK", 4)
    monkeypatch.setattr(tri, "COMPACT_SELECT_CHUNK", 16)
    monkeypatch.setattr(tri, "COMPACT_MIN_ROWS", 0)  # consumers score over their lists
    monkeypatch.setattr(tri, "FILTER_MIN_ROWS", 0)  # top-k filtered wherever blocks >= k
    monkeypatch.setattr(tri, "FILTER_MIN_SCORES", 0)
    monkeypatch.setattr(tri, "FILTER_BLOCK", 3)
    monkeypatch.setattr(tri, "FILTER_CHUNK", 16)
    monkeypatch.setattr(tri, "FILTER_STEP", 8)


@pytest.fixture(params=["passes", "one-program"])
def selection(request, small_tiles, monkeypatch):
    """Small tiles, with each radix select run as its passes over row chunks or, for a
    source of at most SELECT_ONE_PROGRAM entries, as one program a slot."""
    if request.param == "one-program":
        monkeypatch.setattr(tri, "SELECT_ONE_PROGRAM", 1 << 30)
    return request.param


def setup(seqs, n_rows, heads, d, seed, page_rows=4, ties=False, key_scale=None):
    """Paged index keys of len(seqs) sequences on shuffled pages; one query per token (seqs[i]
    tokens of sequence i, packed), with visibility ending at its position as in a prefill.
    key_scale: a factor [len(seqs), n_rows, d] on the keys before they are quantised."""
    g = torch.Generator().manual_seed(seed)
    b = len(seqs)
    pages = -(-n_rows // page_rows)
    table = torch.randperm(b * pages + 2, generator=g)[: b * pages].view(b, pages)
    if ties:  # a few distinct key and query values: many exactly equal scores
        keys = torch.randint(-1, 2, (b, n_rows, d), generator=g).bfloat16()
        q = torch.randint(0, 2, (sum(seqs), heads, d), generator=g).bfloat16()
        w = torch.full((sum(seqs), heads), 0.125).bfloat16()
    else:
        keys = torch.randn(b, n_rows, d, generator=g).bfloat16()
        q = torch.randn(sum(seqs), heads, d, generator=g).bfloat16()
        w = (torch.randn(sum(seqs), heads, generator=g) / 8).bfloat16()
    if key_scale is not None:
        keys = (keys.float() * key_scale).bfloat16()
    pool = torch.zeros(b * pages + 2, page_rows, d // 2 + d // 32, dtype=torch.uint8)
    packed = pack_index_keys(index_fp4_fake_quant(keys))
    for s in range(b):
        for t in range(n_rows):
            pool[table[s, t // page_rows], t % page_rows] = packed[s, t]
    token_row, visible, groups, start = [], [], {}, 0
    for s, m in enumerate(seqs):
        token_row += [s] * m
        top = int(torch.randint(0, n_rows + 1, (1,), generator=g))
        visible += [max(0, top - (m - 1 - i)) for i in range(m)]  # causal: +1 per token
        groups.setdefault(m, []).extend(range(start, start + m))
        start += m
    token_groups = [(m, torch.tensor(ids, device=DEV)) for m, ids in groups.items()]
    return (index_fp4_fake_quant(q).to(DEV), w.to(DEV), pool.to(DEV), table.to(DEV),
            torch.tensor(token_row, device=DEV), torch.tensor(visible, device=DEV),
            token_groups)


def both(args, n_rows, topk, **kw):
    want = ref.index_topk(*args[:6], n_rows, topk, args[6], **kw)
    got = tri.index_topk(*args[:6], n_rows, topk, args[6], **kw)
    return want, got


def assert_same(want, got):
    assert got[0].dtype == torch.int32 and torch.equal(got[0].cpu(), want[0].cpu())
    if want[1] is None:
        assert got[1] is None
    else:
        assert got[1].dtype == torch.bool and torch.equal(got[1].cpu(), want[1].cpu())


@pytest.mark.parametrize("d,heads", [(32, 4), (128, 32)], ids=["tiny-bytes", "flash-words"])
def test_decode_queries_and_candidate_source(d, heads, selection):
    """One query per sequence (decode), 37 rows: 3 scoring tiles, 3 selection chunks, a
    partial last candidate block; topk 5 and more than the rows."""
    args = setup([1, 1, 1, 1], 37, heads, d, seed=d)
    args[5][0] = 0  # a query that sees nothing: all -1, nothing kept, nothing pinned
    args[5][1] = 1  # one visible row: its block pinned
    for topk in (5, 40):
        want, got = both(args, 37, topk, candidate_topk=3, block_size=3)
        assert_same(want, got)
    assert (got[0][0] == -1).all() and not got[1][0].any()


@pytest.mark.parametrize("per_sm", [0, 1 << 20], ids=["long-runs", "one-tile-runs"])
def test_decode_rows_over_runs_of_tiles(per_sm, small_tiles, monkeypatch):
    """Decode rows scored by programs of up to 4 row tiles (a partial last run) or of one tile
    each (too few programs to fill the SMs: the decode of few queries): the same selection."""
    monkeypatch.setattr(tri, "SCORE_TILES_PER_PROGRAM", 4)
    monkeypatch.setattr(tri, "SCORE_PROGRAMS_PER_SM", per_sm)
    args = setup([1, 1], 83, 4, 32, seed=5)  # 6 row tiles of 16: runs of 4 and 2
    args[5][0] = 70  # visible ends in the second run
    want, got = both(args, 83, 9, candidate_topk=4, block_size=5)
    assert_same(want, got)


def test_score_programs_fill_the_sms():
    """Row tiles a scoring program: 8 where the programs fill the SMs, fewer for few queries
    (one query over 2048 rows: one tile a program, 16 programs), never below 1."""
    assert tri._score_tiles_per_prog(1, 16, 132) == 1
    assert tri._score_tiles_per_prog(64, 16, 132) == 2  # 512 programs
    assert tri._score_tiles_per_prog(512, 16, 132) == 8  # 1024
    assert tri._score_tiles_per_prog(66, 8, 132) == 2  # 264 programs: exactly 2 an SM
    assert tri._score_tiles_per_prog(65, 8, 132) == 1  # 260 at 2 tiles: too few
    assert tri._score_tiles_per_prog(1, 1, 132) == 1


@pytest.mark.parametrize("tile", [4, 8])
@pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "radix"])
def test_prefill_tiles_ties_and_query_chunks(filtered, tile, selection, monkeypatch):
    """Sequences of 6, 1 and 3 tokens (query tiles of 4 or 8 with a partial one and a mixed
    step), tie-heavy scores, and a score budget of one tile per chunk; the top-k through the
    filter or the radix select."""
    monkeypatch.setattr(tri, "PREFILL_TILE", tile)
    if not filtered:
        monkeypatch.setattr(tri, "FILTER_MIN_ROWS", 1 << 30)
    args = setup([6, 1, 3], 29, 4, 32, seed=3, ties=True)
    want, got = both(args, 29, 7, candidate_topk=2, block_size=4)
    assert_same(want, got)
    got_chunked = tri.index_topk(*args[:6], 29, 7, args[6], candidate_topk=2, block_size=4,
                                 score_budget=1)
    assert_same(want, got_chunked)


class _PoisonedTorch:
    """torch for the kernel module, whose ``empty`` buffers come back filled with values a
    read before a write would show: bf16 NaN scores and NaN keys (the largest: a top-k takes
    them first), huge counts, kept flags set, rows out of range."""

    POISON = {torch.int16: 0x7FC0, torch.int32: 0xFFFF, torch.uint8: 0xFF, torch.bool: True}

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *shape, **kw):
        t = torch.empty(*shape, **kw)
        return t.fill_(self.POISON.get(t.dtype, float("nan")))


@pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "radix"])
def test_prefill_clips_rows_past_each_query(filtered, selection, monkeypatch):
    """A prefill's queries see causal prefixes of the rows: scoring and selection stop at each
    query's visible rows (and k), the rows past them neither scored nor read. The kernel's
    scratch buffers are poisoned, so any read past a query's width changes its selection:
    prompts whose queries see 0 to 4 rows (fewer than k), 20 to 23, 82 to 87 and every one of
    90 rows, a query tile straddling two widths; the candidate source's kept flags (zero past
    a query's blocks), and a consumer walking every row."""
    monkeypatch.setattr(tri, "torch", _PoisonedTorch())
    if not filtered:
        monkeypatch.setattr(tri, "FILTER_MIN_ROWS", 1 << 30)
    monkeypatch.setattr(tri, "COMPACT_MIN_ROWS", 1 << 30)  # the consumer walks every row
    n = 90
    args = setup([5, 4, 6, 1], n, 4, 32, seed=17, ties=True)
    args[5][:] = torch.tensor([0, 1, 2, 3, 4, 20, 21, 22, 23, 82, 83, 84, 85, 86, 87, n])
    want, got = both(args, n, 6, candidate_topk=5, block_size=4)  # blocks past k's rows
    assert_same(want, got)
    assert tri.index_topk(*args[:6], n, 6, args[6], candidate_topk=5, block_size=4,
                          score_budget=1)[0].equal(got[0])  # one query tile per chunk
    cand = kept_blocks(16, -(-n // 4), seed=18, density=0.2).to(DEV)
    want, got = both(args, n, 6, candidates=cand, block_size=4)
    assert_same(want, got)


def test_consumer_reads_kept_blocks_and_wider_candidates(selection):
    """A Reindex consumer scores only rows inside the source's kept blocks (a source scanning
    more rows than the consumer: a wider candidate mask), with fewer kept rows than k so the
    reference's -inf ties past the kept blocks decide the rest."""
    args = setup([2, 1, 4], 26, 4, 32, seed=5)
    src = setup([2, 1, 4], 33, 4, 32, seed=6)
    _, keep = ref.index_topk(*src[:6], 33, 4, src[6], candidate_topk=2, block_size=4)
    want, got = both(args, 26, 12, candidates=keep, block_size=4)
    assert_same(want, got)


def kept_blocks(t, nblk, seed, density=0.3):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(t, nblk, generator=g) < density


@pytest.mark.parametrize("tiles,programs", [(2, 6), (1, 12)], ids=["runs2", "strided"])
def test_consumer_lists_decode(tiles, programs, small_tiles, monkeypatch):
    """A consumer scores and selects over its list (kept blocks and the blocks of rows below
    k, ascending): no kept block, only the partial last block, a visible limit inside the one
    kept block, fewer kept rows than k (-inf ties to the lower rows decide), every block kept,
    nothing visible; tie-heavy scores; a block size that is no power of two; lists over
    several compaction, scoring and selection programs (scoring: a list's runs of two row
    tiles in one program, or runs of one tile over two programs, each taking every other)."""
    monkeypatch.setattr(tri, "SCORE_TILES_PER_PROGRAM", tiles)
    monkeypatch.setattr(tri, "COMPACT_OWNERS_PER_TILE", 1)
    monkeypatch.setattr(tri, "COMPACT_PROGRAMS", programs)  # per list: programs / 6
    n, bs = 35, 3
    nblk = -(-n // bs)
    args = setup([1] * 6, n, 4, 32, seed=11, ties=True)
    args[5][:] = torch.tensor([n, n, 5 * bs + 2, 28, n, 0])
    cand = kept_blocks(6, nblk + 1, seed=12)  # one block wider than the rows, as a source's
    cand[0] = False  # nothing kept: rows 0 .. k-1 (-inf), -1 past visible
    cand[1] = False
    cand[1, nblk - 1] = True  # the partial last block only
    cand[2] = False
    cand[2, 5] = True  # visible ends inside it
    cand[4] = True
    cand[5, [0, nblk - 1]] = True  # nothing visible
    want, got = both(args, n, 12, candidates=cand.to(DEV), block_size=bs)
    assert_same(want, got)


def test_consumer_lists_prefill_tiles_and_chunks(small_tiles):
    """Prefill query tiles of a consumer share one list (the union of their queries' kept
    blocks; a query's rows outside its own kept blocks stay -inf): mixed sequence lengths
    (partial tiles, a one-token sequence), tie-heavy scores, query chunks of two tiles."""
    n, bs = 29, 4
    args = setup([5, 1, 3], n, 4, 32, seed=13, ties=True)
    cand = kept_blocks(9, -(-n // bs), seed=14, density=0.25)
    cand[5] = False  # the one-token sequence keeps nothing
    cand[6, -1] = True
    want, got = both(args, n, 9, candidates=cand.to(DEV), block_size=bs,
                     score_budget=2 * (4 * 32 * 2 + 8 * 4))  # two query tiles per chunk
    assert_same(want, got)


@pytest.mark.parametrize("d,heads", [(32, 4), (128, 8)], ids=["tiny-bytes", "words"])
def test_key_scales_wide_tiny_and_spread(d, heads, small_tiles):
    """Key scales the one-multiply decode cannot take (past 2^1, ue8m0 byte > 128: tiles
    decoded with two multiplies), tiny ones (2^-100: e2m1 0.5 codes on bf16 subnormals before
    their scale), scale blocks of one row spread over 9 octaves, and tiles mixing a few wide
    rows into ordinary ones (16-row tiles over 64 rows): the selection per sequence is the
    reference's."""
    n = 64
    f = torch.ones(4, n, d)
    f[0] = 2.0 ** 40
    f[1] = 2.0 ** -100
    f[2] = 2.0 ** (3 * (torch.arange(d) // 32) - 4.0)  # blocks 2^-4, 2^-1, 2^2, 2^5
    f[3, ::7] = 2.0 ** 12
    args = setup([1, 1, 1, 1], n, heads, d, seed=21, key_scale=f)
    args[5].fill_(n)
    want, got = both(args, n, 12, candidate_topk=3, block_size=4)
    assert_same(want, got)
    pool = args[2].cpu()
    e = pool[..., d // 2:]
    assert (e > 128).any() and (e < 40).any()  # both decodes and tiny scales ran


@pytest.mark.parametrize("scale", [1 / 64, 0.1], ids=["flash", "rounding"])
def test_head_scale_is_applied_as_the_layer_did(scale, small_tiles):
    """head_scale: the head weights used are bf16(head_weights * scale), as the layer's
    ``weights_proj(x) * index_weight_scale`` made them before the indexer took the scale
    (one launch fewer): both backends select as with pre-scaled weights, a decode step and a
    prefill, the candidate source's kept blocks too, and score alike (seen through the reduce
    hook; decode: a prefill's kernel leaves rows past a query's width unwritten); a scale that
    rounds (0.1) as well."""
    for seqs in ([1, 1, 1], [5, 1, 3]):
        args = setup(seqs, 29, 4, 32, seed=19)
        raw = (args[1].float() * 8).bfloat16()  # weights_proj's output, before the scale
        for impl in (ref, tri):
            seen = []

            def keep(s):
                seen.append(s.clone())
                return s

            want = impl.index_topk(args[0], raw * scale, *args[2:6], 29, 6, args[6],
                                   candidate_topk=2, block_size=4, reduce=keep)
            got = impl.index_topk(args[0], raw, *args[2:6], 29, 6, args[6], candidate_topk=2,
                                  block_size=4, head_scale=scale, reduce=keep)
            assert_same(want, got)
            if len(seqs) == 3 and max(seqs) == 1:
                a, b = seen
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))
                assert torch.isfinite(a.float()).any()


def test_unallocated_pages_read_zero_keys():
    args = list(setup([1, 3], 12, 4, 32, seed=7))
    args[3][:, -1] = -1  # never allocated
    args[5].fill_(12)
    want, got = both(args, 12, 12)
    assert_same(want, got)


def test_bad_arguments_name_the_value():
    args = setup([1], 8, 4, 32, seed=8)
    with pytest.raises(ValueError, match="key_pool"):
        tri.index_topk(args[0], args[1], args[2][..., :-1], *args[3:6], 8, 4, args[6])
    with pytest.raises(ValueError, match="candidates"):
        tri.index_topk(*args[:6], 8, 4, args[6], candidates=torch.ones(2, 1, dtype=torch.bool,
                                                                         device=DEV))
    q, w, pool, table, rows, vis, groups = args
    bad = {"head_weights": (q, w[:, :2], pool, table, rows, vis, 8, 4),
           "visible": (q, w, pool, table, rows, vis.float(), 8, 4),
           "token_row": (q, w, pool, table, rows[:0], vis, 8, 4),
           # 2 pages of 4 rows (setup's page_rows) cannot hold 9 rows
           "n_rows=9": (q, w, pool, table, rows, vis, 9, 4),
           "topk": (q, w, pool, table, rows, vis, 8, 0)}
    for name, call in bad.items():
        with pytest.raises(ValueError, match=name):
            tri.index_topk(*call, groups)


@pytest.mark.parametrize("role", ["source", "consumer", "consumer-lists", "source-filtered"])
def test_reduce_hook_combines_partial_heads_like_the_reference(role, monkeypatch):
    """Tensor parallelism's hook: each half of the heads scores on its own and ``reduce`` adds
    the other half's bf16 partial scores before candidates and top-k (as the all-reduce does);
    the kernel's combined selection equals the reference's (a consumer's scores over every
    row, or over its list: both halves list the same rows; a source's top-k through the
    filter)."""
    if role == "consumer-lists":
        monkeypatch.setattr(tri, "COMPACT_MIN_ROWS", 0)
    if role == "source-filtered":
        for name, value in (("FILTER_MIN_ROWS", 0), ("FILTER_MIN_SCORES", 0),
                            ("FILTER_BLOCK", 2), ("FILTER_CHUNK", 8)):
            monkeypatch.setattr(tri, name, value)
    args = setup([3, 1], 21, 4, 32, seed=9)
    q, w = args[0], args[1]
    kw = dict(candidate_topk=2) if role.startswith("source") else dict(
        candidates=kept_blocks(4, 6, seed=10, density=0.5).to(DEV))
    halves = [(q[:, :2], w[:, :2]), (q[:, 2:], w[:, 2:])]
    for impl in (ref, tri):
        stash = []

        def keep_partial(s):
            stash.append(s.clone())
            return s

        def add_partial(s, it=iter(stash)):
            return (s.float() + next(it).float()).bfloat16()

        impl.index_topk(*halves[1], *args[2:6], 21, 5, args[6], block_size=4,
                        reduce=keep_partial, **kw)
        got = impl.index_topk(*halves[0], *args[2:6], 21, 5, args[6], block_size=4,
                              reduce=add_partial, **kw)
        if impl is ref:
            want = got
    assert_same(want, got)


def order_keys(scores):
    """_order_key of bf16 scores, in torch: larger key = larger score, -0 = +0, NaN largest."""
    bits = scores.view(torch.int16).to(torch.int32) & 0xFFFF
    key = torch.where(bits & 0x8000 != 0, ~bits & 0xFFFF, bits | 0x8000)
    key = torch.where(bits & 0x7FFF == 0, 0x8000, key)
    return torch.where(bits & 0x7FFF > 0x7F80, 0xFFFF, key)


@pytest.mark.parametrize("path", ["filtered", "radix"])
def test_selection_above_and_at_the_threshold(path, selection):
    """The two top-k paths of bf16 scores against the reference's selection on crafted scores.
    The filter (t = the k-th largest block maximum; rows above t listed, or the selection
    written at once): distinct scores (more than k above t: a radix select over the list), few
    distinct values (fewer: t is the k-th largest), mostly -inf rows (t = -inf: the lowest
    -inf rows fill the selection), all -inf, NaN, -0 against +0. Both: visible limits (rows
    past them -inf, as the scoring kernel writes them) of 23, 3 (< k) and 0; n not a
    multiple of the block, chunks or steps; nothing written past a query's k."""
    n, k, fb = 50, 7, tri.FILTER_BLOCK
    g = torch.Generator().manual_seed(31)
    rows = [torch.randn(n, generator=g),  # distinct
            torch.randint(0, 3, (n,), generator=g).float(),  # ties
            torch.full((n,), float("-inf")), torch.full((n,), float("-inf")),
            torch.randint(-1, 2, (n,), generator=g).float() * 0.0,  # -0 and +0
            torch.randn(n, generator=g), torch.randn(n, generator=g),
            torch.randint(0, 2, (n,), generator=g).float()]
    rows[2][[3, 17, 40, 41]] = torch.tensor([1.0, -2.0, 1.0, 5.0])  # 4 finite rows < k
    rows[5][[5, 9, 30]] = float("nan")
    visible = torch.tensor([n, n, n, n, n, 23, 3, 0])
    # -inf past visible, as the scoring kernel writes them
    scores = ref.mask_invisible(torch.stack(rows).bfloat16()[:, None], visible[:, None])[:, 0]
    want = ref.select_topk(scores[:, None], visible[:, None], k)[:, 0]
    out = torch.full((len(rows), k + 2), -7, dtype=torch.int32, device=DEV)
    args = (scores.view(torch.int16).to(DEV), k, out[:, :k], visible.to(DEV), (None, None, 1),
            0, 0, len(rows), n)
    if path == "filtered":
        tri._select_filtered(*args)
    else:
        tri._select(*args, True, False)
    assert torch.equal(out[:, :k].cpu(), want)
    assert (out[:, k:] == -7).all()  # nothing written past a query's k
    if path == "filtered":  # both of the selection program's branches ran
        keys = order_keys(scores)
        blocks = torch.nn.functional.pad(keys, (0, -n % fb), value=0x7F).view(len(rows), -1, fb)
        t = blocks.amax(-1).sort(-1, descending=True).values[:, k - 1]
        above = (keys > t[:, None]).sum(-1)
        assert (above >= k).any() and (above < k).any() and (t == 0x7F).any()


@pytest.mark.parametrize("digit", [1, 2], ids=["bit", "two-bits"])
@pytest.mark.parametrize("n, k", [(5, 7), (7, 7), (64, 7), (64, 1), (64, 64), (300, 37)])
def test_one_program_selection_bitwise_search(n, k, digit, monkeypatch):
    """The one-program top-k (_select_one_kernel: u by a search over its 16 bits, one or two
    a step: SEARCH_DIGIT_BITS) against the reference on keys built to walk every bit: scores
    that differ only in their lowest bits (adjacent bf16 values), a run of equal scores across
    the k-th place, all equal, -inf below finite ones, fewer entries than k (every entry
    taken), k = 1 and k = n. Nothing is written past a query's min(n, k) entries."""
    monkeypatch.setattr(tri, "SEARCH_DIGIT_BITS", digit)
    g = torch.Generator().manual_seed(n * 100 + k)
    base = torch.tensor(1.0).bfloat16().view(torch.int16)
    adjacent = (base + torch.randperm(n, generator=g).to(torch.int16)).view(torch.bfloat16)
    rows = [adjacent,
            torch.full((n,), 0.25).bfloat16(),  # all equal
            torch.randint(0, 3, (n,), generator=g).bfloat16() - 1,  # runs of ties, -0 among them
            torch.where(torch.arange(n) % 3 == 0, float("-inf"),
                        torch.randn(n, generator=g)).bfloat16(),
            (-torch.rand(n, generator=g) * 1e30).bfloat16()]
    scores = torch.stack(rows)
    visible = torch.full((len(rows),), n)
    want = ref.select_topk(scores[:, None], visible[:, None], k)[:, 0]
    out = torch.full((len(rows), k + 2), -7, dtype=torch.int32, device=DEV)
    assert tri._one_program(n, False)
    tri._select(scores.view(torch.int16).to(DEV), k, out[:, :k], visible.to(DEV),
                (None, None, 1), 0, 0, len(rows), n, True, False)
    taken = min(n, k)
    assert torch.equal(out[:, :taken].cpu(), want)
    assert (out[:, taken:] == -7).all()


@pytest.mark.skipif(not torch.cuda.is_available() or tri.interpreting(),
                    reason="compiled kernels at V4.1-Flash shapes need a GPU")
@pytest.mark.parametrize("case", ["distinct", "ties"])
def test_flash_shapes_on_the_gpu(case):
    """V4.1-Flash's indexer (32 heads x 128, top-512, 2048 candidate blocks of 8) on the GPU
    with its default tiles: 64 decode queries over 48K rows each (the filtered top-k), a
    candidate source over them, 8 queries over 40K rows (the radix select's passes), 16 over
    4K rows (the rows selected by one program a query), 4 over 70000 (the candidate blocks by
    the passes; up to 64K rows one program a query selects them), on shuffled
    pages of random fp4 keys (distinct scores) or of four key words (tie-heavy scores, most
    selections decided by the lower row); visible limits from 0 to every row."""
    from dsv41attn.config import preset
    from dsv41attn.ops.common.packing import index_key_bytes

    cfg = preset("v41-flash")
    heads, d, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    g = torch.Generator(device="cuda").manual_seed(41 if case == "distinct" else 43)
    for b, n in ((64, 48 * 1024), (8, 40 * 1024), (16, 4096), (4, 70000)):
        assert tri._filters(b, n, k) == (b == 64)
        assert tri._one_program(n, False) == (n == 4096)
        assert tri._one_program(-(-n // cfg.candidate_block_size), False) == (n < 65536)
        page_rows = 256
        pages = b * (-(-n // page_rows)) + 3
        nbytes = index_key_bytes(d)
        if case == "distinct":
            pool = torch.randint(0, 256, (pages, page_rows, nbytes), generator=g,
                                 device="cuda", dtype=torch.int32).to(torch.uint8)
        else:
            words = torch.tensor([0x00, 0x22, 0xA2, 0x11], dtype=torch.uint8, device="cuda")
            pool = words[torch.randint(0, 4, (pages, page_rows, 1), generator=g,
                                       device="cuda")].expand(-1, -1, nbytes).contiguous()
        pool[..., d // 2:] = 120 + (case == "distinct") * torch.randint(
            0, 8, pool[..., d // 2:].shape, generator=g, device="cuda").to(torch.uint8)
        table = torch.randperm(pages, generator=g, device="cuda")[: pages - 3].view(b, -1)
        q = index_fp4_fake_quant(torch.randn(b, heads, d, generator=g, device="cuda").bfloat16())
        w = (torch.randn(b, heads, generator=g, device="cuda") * 0.1).bfloat16()
        rows = torch.arange(b, device="cuda")
        vis = torch.randint(0, n + 1, (b,), generator=g, device="cuda")
        vis[:4] = torch.tensor([0, 1, k - 3, n], device="cuda")
        args = (q, w, pool, table, rows, vis, n, k, [(1, rows)])
        kw = dict(candidate_topk=cfg.candidate_topk_blocks, block_size=cfg.candidate_block_size)
        want, got = ref.index_topk(*args, **kw), tri.index_topk(*args, **kw)
        assert_same(want, got)


@pytest.mark.skipif(not torch.cuda.is_available() or tri.interpreting(),
                    reason="compiled kernels at V4.1-Flash shapes need a GPU")
def test_flash_shapes_prefill_on_the_gpu():
    """V4.1-Flash's indexer in prefill on the GPU, each query's scoring and top-k stopping at
    its visible rows: a sequence's first 6K tokens (query i sees rows 0 .. i) beside a 2K-token
    chunk at position 40K of another (43K rows: the filtered top-k), then the first sequence
    alone (the radix select), as the candidate source, on shuffled pages of random fp4
    keys."""
    from dsv41attn.config import preset
    from dsv41attn.ops.common.packing import index_key_bytes

    cfg = preset("v41-flash")
    heads, d, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    g = torch.Generator(device="cuda").manual_seed(47)
    first, chunk, start = 6144, 2048, 40960
    n, page_rows = start + chunk, 256
    pages = 2 * (n // page_rows) + 3
    pool = torch.randint(0, 256, (pages, page_rows, index_key_bytes(d)), generator=g,
                         device="cuda", dtype=torch.int32).to(torch.uint8)
    pool[..., d // 2:] = torch.randint(118, 128, pool[..., d // 2:].shape, generator=g,
                                       device="cuda", dtype=torch.int32).to(torch.uint8)
    table = torch.randperm(pages, generator=g, device="cuda")[: pages - 3].view(2, -1)
    t = first + chunk
    q = index_fp4_fake_quant(torch.randn(t, heads, d, generator=g, device="cuda").bfloat16())
    w = (torch.randn(t, heads, generator=g, device="cuda") * 0.1).bfloat16()
    rows = torch.cat([torch.zeros(first, dtype=torch.long), torch.ones(chunk, dtype=torch.long)])
    vis = torch.cat([torch.arange(1, first + 1), torch.arange(start + 1, n + 1)])
    ids = torch.arange(t, device="cuda")
    kw = dict(candidate_topk=cfg.candidate_topk_blocks, block_size=cfg.candidate_block_size)
    calls = [((q, w, pool, table, rows.cuda(), vis.cuda(), n, k,
               [(first, ids[:first]), (chunk, ids[first:])]), True),
             ((q[:first], w[:first], pool, table, rows[:first].cuda(), vis[:first].cuda(),
               first, k, [(first, ids[:first])]), False)]
    for args, filtered in calls:
        assert tri._filters(args[0].shape[0], args[6], k) == filtered
        want, got = ref.index_topk(*args, **kw), tri.index_topk(*args, **kw)
        assert_same(want, got)
