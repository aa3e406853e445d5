"""Triton fp8 linear against the reference (SPEC §2.1-2.2); runs under TRITON_INTERPRET=1 on CPU."""
import dataclasses
import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

import dsv41attn.ops.linear.triton as T
from conftest import bytes_of, poison_empty
from dsv41attn.checkpoint import quantize_fp8
from dsv41attn.ops.common.quant import act_quant as ref_act_quant
from dsv41attn.ops.common.triton import DEFAULT_SM_COUNT, interpreting, sm_count
from dsv41attn.ops.linear.reference import fp8_gemm as ref_gemm
from dsv41attn.ops.linear.reference import fp8_linear as ref_linear
from dsv41attn.ops.linear.triton import act_quant, fp8_gemm, fp8_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending (fp32)."""
    v = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v.sort().values


def _check_quant(x: torch.Tensor) -> None:
    q, s = act_quant(x.to(DEV))
    rq, rs = ref_act_quant(x.cpu())
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s.cpu(), rs)  # exact, powers of two
    assert torch.equal(q.cpu().float(), rq)  # exact e4m3 values (+0 == -0)
    # bytes too: the reference's e4m3 is torch's saturating RNE cast of the clamped quotient
    ref_bytes = rq.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q.cpu().view(torch.uint8), ref_bytes)


def test_host_cdiv_and_next_pow2_are_tritons():
    """The host's plain launch-planning helpers give Triton's integers (every n to 2^17, the
    edges of wide ones); the kernels' grids and block sizes are built from them."""
    from dsv41attn.ops.common.triton import cdiv, next_pow2
    ns = list(range(0, 1 << 17)) + [(1 << e) + d for e in range(17, 62) for d in (-1, 0, 1)]
    assert [next_pow2(n) for n in ns] == [triton.next_power_of_2(n) for n in ns]
    for y in (1, 2, 3, 16, 32, 64, 127, 128, 1000):
        assert [cdiv(x, y) for x in ns[:5000] + ns[-90:]] == \
            [triton.cdiv(x, y) for x in ns[:5000] + ns[-90:]]


@pytest.mark.parametrize("seed", [0, 1])
def test_act_quant_random(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 32 * 37, generator=g) * torch.logspace(-6, 6, 7)[:, None]
    _check_quant(x.bfloat16())


def test_act_quant_every_bf16():
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    g = torch.Generator().manual_seed(3)
    x = x[torch.randperm(x.numel(), generator=g)]  # every finite bf16 value, in mixed blocks
    _check_quant(x[: x.numel() // 1024 * 1024].view(-1, 1024))
    _check_quant(x.sort().values[: x.numel() // 1024 * 1024].view(-1, 1024))  # similar blocks


def test_act_quant_edges():
    g = torch.Generator().manual_seed(2)
    grid = _e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2  # exact midpoints (ties), incl. subnormal ones
    rows = []
    for e in (-3, 0, 5):  # block amax = 448 * 2^e so the scale is exactly 2^e
        t = torch.cat([mids, grid, -mids, -grid])
        t = t[torch.randperm(t.numel(), generator=g)]
        t = t[: t.numel() // 32 * 32].view(-1, 32).clone()
        t[:, 0] = 448.0
        rows.append((t * 2.0 ** e).reshape(-1))
    ties = torch.cat(rows)
    ties = ties[: ties.numel() // 1024 * 1024].view(-1, 1024)
    assert torch.equal(ties.bfloat16().float(), ties)  # midpoints need <= 5 bits: bf16 exact
    _check_quant(ties.bfloat16())
    z = torch.zeros(6, 64)
    z[1] = 3e-5 * torch.randn(64, generator=g)  # amax < 1e-4: scale from the floor
    z[2] = 2.0 ** torch.randint(-20, 20, (64,), generator=g).float()  # exact powers of two
    z[3] = 1e30 * torch.randn(64, generator=g)  # huge
    z[4, :32] = 448.0 * 2.0 ** -10  # amax/448 a power of two: no round-up
    z[4, 32:] = -1e-38  # subnormal-ish bf16 inputs under the floor
    z[5] = torch.randn(64, generator=g) * 1e-3
    z[5, 7] = -0.0
    _check_quant(z.bfloat16())  # row 0: zeros


def _quantized(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = quantize_fp8(torch.randn(n, k, generator=g) / k ** 0.5)
    return w.weight, w.scale


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n", [37, 64, 96])
@pytest.mark.parametrize("k", [32, 96, 160])
def test_fp8_linear_vs_reference(m, n, k):
    w, ws = _quantized(n, k, seed=m * 1000 + n * 10 + k)
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    ref = ref_linear(x, w, ws)
    y1 = fp8_linear(x.to(DEV), w.to(DEV), ws.to(DEV), num_splits=1).cpu()  # K in order
    y = fp8_linear(x.to(DEV), w.to(DEV), ws.to(DEV)).cpu()  # split-K by shape (fp32 order)
    for got in (y1, y):
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        err = (got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)
        assert err <= 1e-2
    if interpreting():  # fp64 block sums on the CPU: the reference's rounding points exactly
        assert torch.equal(y1, ref)


@pytest.mark.parametrize("precise", [False, True])
def test_fp8_linear_batched_and_gemm_exact(precise):  # precise_dot: GPU only (fp16 to tl.dot)
    w, ws = _quantized(70, 128, seed=3)
    x = torch.randn(2, 3, 128).bfloat16()
    y = fp8_linear(x.to(DEV), w.to(DEV), ws.to(DEV), precise_dot=precise).cpu()
    ref = ref_linear(x, w, ws)
    assert y.shape == (2, 3, 70)
    assert (y.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
    q, s = act_quant(x.reshape(-1, 128).to(DEV))
    out = torch.full((6, 70), float("nan"), device=DEV)  # poisoned: every element is written
    got = fp8_gemm(q, s, w.to(DEV), ws.to(DEV), out=out, num_splits=1, precise_dot=precise)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    ref32 = ref_gemm(q.cpu().float(), s.cpu(), w, ws)
    if interpreting():
        assert torch.equal(out.cpu(), ref32)
    else:
        tol = (1e-6 if precise else 1e-4) * ref32.abs().max()  # fp8 wgmma sums less precisely
        assert (out.cpu() - ref32).abs().max() <= tol


def test_bad_inputs():
    w, ws = _quantized(64, 96, seed=4)
    w, ws = w.to(DEV), ws.to(DEV)
    x = torch.randn(3, 96).bfloat16().to(DEV)
    q, s = act_quant(x)
    with pytest.raises(TypeError):
        act_quant(x.float())
    with pytest.raises(ValueError):
        act_quant(torch.randn(3, 40).bfloat16().to(DEV))  # K not a multiple of 32
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(3, 64).bfloat16().to(DEV), w, ws)  # K mismatch
    with pytest.raises(TypeError):
        fp8_gemm(q.float(), s, w, ws)
    with pytest.raises(TypeError):
        fp8_gemm(q, s, w, ws.float())
    with pytest.raises(ValueError):
        fp8_gemm(q, s[:, :2], w, ws)
    with pytest.raises(ValueError):
        fp8_gemm(q, s, w, ws[:1])
    with pytest.raises(ValueError):
        fp8_gemm(q, s, w, ws, out=torch.empty(3, 63, device=DEV))
    for splits in (0, 4):  # K/32 = 3 blocks: 1..3 splits
        with pytest.raises(ValueError, match="num_splits"):
            fp8_gemm(q, s, w, ws, num_splits=splits)


def _split_x(m, k, seed):
    """bf16 activations with a wide range across K blocks (so fp32 sums round unevenly)."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k // 32).repeat_interleave(32)
    return x.bfloat16()


def _split_case(m, n, k, seed):
    """Quantised operands of _split_x's activations."""
    w, ws = _quantized(n, k, seed)
    q, s = act_quant(_split_x(m, k, seed).to(DEV))
    return q, s, w, ws


def _block_terms(q, s, w, ws):
    """([M, N, KB] fp32 block terms, [M, N] fp64 oracle) of the same quantised operands. Term b
    is block b's exact dot rounded once to fp32, times both scales (powers of two: exact): the
    reference's summands. The oracle sums the exact block dots in fp64 (relative 2^-53 * KB)."""
    m, k = q.shape
    n, kb = w.shape[0], k // 32
    xb = q.cpu().float().double().view(m, kb, 32)
    wb = w.double().view(n, kb, 32)
    exact = torch.einsum("mbk,nbk->mnb", xb, wb)  # e4m3 products and their 32-sums fit fp64
    scale = s.cpu()[:, None, :] * ws.float().repeat_interleave(32, 0)[:n][None]  # [M, N, KB]
    terms = exact.float() * scale
    return terms, (exact * scale.double()).sum(-1)


SPLIT_CASES = {  # id: (M, N, K, num_splits); N off the 64-wide tile, K/32 uneven across ranges
    "m1-n70-kb13-s4": (1, 70, 416, 4),  # chunks of 1 block: ranges of 3, 3, 3, 4 blocks
    "m3-n100-kb24-s2": (3, 100, 768, 2),  # chunks of 8: 8 + 16 blocks
    "m3-n37-kb5-s5": (3, 37, 160, 5),  # one block per range
    "m17-n70-kb13-s5": (17, 70, 416, 5),  # BLOCK_M 64 tile: 2, 3, 2, 3, 3 blocks
    "m64-n130-kb24-s3": (64, 130, 768, 3),  # KSUB 4 in chunks of 8: 8 blocks each
    "m1-n70-kb24-auto": (1, 70, 768, None),  # k_order's own choice (6 ranges of 4 blocks)
    "m80-n70-kb24-auto": (80, 70, 768, None),  # the same order, summed inside each tile
}


@pytest.mark.parametrize("case", list(SPLIT_CASES), ids=list(SPLIT_CASES))
def test_split_k_vs_oracle(case):
    m, n, k, splits = SPLIT_CASES[case]
    kb = k // 32
    q, s, w, ws = _split_case(m, n, k, seed=kb * 100 + m)
    plan = T._gemm_plan(m, n, kb, DEFAULT_SM_COUNT if DEV == "cpu" else
                        sm_count(torch.device(DEV)), splits)
    order = plan.order
    assert order.ranges > 1 and kb % order.granule == 0 and order.chunks >= order.ranges
    assert order.granule % plan.ksub == 0  # no K step straddles two ranges
    runs = []
    for workspace in (True, False, True):  # split-K programs, then one program summing them
        out = torch.full((m, n), float("nan"), device=DEV)  # poisoned: every element is written
        fp8_gemm(q, s, w.to(DEV), ws.to(DEV), out=out, num_splits=splits, workspace=workspace)
        assert not torch.isnan(out).any()
        runs.append(out.cpu())
    for other in runs[1:]:  # deterministic, and the same bits wherever the ranges run
        assert torch.equal(runs[0].view(torch.int32), other.view(torch.int32))
    y = runs[0]
    terms, oracle = _block_terms(q, s, w, ws)
    y_ref = ref_gemm(q.cpu().float(), s.cpu(), w, ws)
    # Bound: y and y_ref are fp32 sums of the same KB fp32 terms t_b, associated differently.
    # Any such sum is sum(t) + the KB - 1 rounding errors of its additions, each <= 2^-24 |s_i|
    # (RNE; no overflow; subnormal sums are exact), and every intermediate s_i is a sum of a
    # contiguous K range of t (the ranges' running sums, the merge's prefixes; the reference's
    # prefixes) up to its own earlier roundings, so |s_i| <= W (1 + 2^-16) for KB < 256, with
    # W = max - min of t's prefix sums (0 included). Through sum(t), the triangle inequality:
    #   |y - oracle| <= |y_ref - oracle| + 2 (KB - 1) 2^-24 W (1 + 2^-16),
    # i.e. the reference's own error plus KB - 1 fp32 ulps of W (>= |y|, ~max|y| here). A lost,
    # doubled or misscaled block costs ~|t_b|, far above it. On a GPU the kernel's block dots
    # are the mma's, not exact: add the fp16-dot slack of test_fp8_linear_batched_and_gemm_exact.
    prefix = torch.cat([torch.zeros(m, n, 1, dtype=torch.float64),
                        terms.double().cumsum(-1)], -1)
    width = prefix.amax(-1) - prefix.amin(-1)
    bound = (y_ref.double() - oracle).abs() + 2 * (kb - 1) * 2.0 ** -24 * width * (1 + 2 ** -16)
    if not interpreting():
        bound = bound + 1e-6 * oracle.abs().max()
    assert ((y.double() - oracle).abs() <= bound).all()
    if interpreting():  # exact block terms: the documented order reproduces every bit
        parts = []
        for lo, hi in map(order.bounds, range(order.ranges)):  # each range in K order
            acc = terms[..., lo].clone()
            for b in range(lo + 1, hi):
                acc += terms[..., b]
            parts.append(acc)
        want = parts[0]
        for part in parts[1:]:  # then the ranges in order
            want = want + part
        assert torch.equal(y, want)
        if case == "m64-n130-kb24-s3":  # the data does tell the two summation orders apart
            assert not torch.equal(y, y_ref)


def test_rows_alone_equal_rows_in_any_batch():
    """The default plan at M = 1, 5 (the decode kernel, split-K programs, 16-row tiles), 40
    (64-row tiles) and 130 (_fp8_gemm_kernel's 128-row tiles, each program summing the
    ranges): every row has the bits it has alone (on a GPU too: every tile runs the same mma
    instruction)."""
    n, k = 70, 768
    q, s, w, ws = _split_case(130, n, k, seed=5)
    w, ws = w.to(DEV), ws.to(DEV)
    sms = DEFAULT_SM_COUNT if DEV == "cpu" else sm_count(torch.device(DEV))
    plans = {m: T._gemm_plan(m, n, k // 32, sms) for m in (1, 5, 40, 130)}
    assert len({p.order for p in plans.values()}) == 1 and plans[1].order.ranges > 1
    assert all(plans[m].swap and plans[m].workspace for m in (1, 5, 40))
    assert not plans[130].swap and plans[130].workspace  # 2 tiles: the ranges as programs
    assert plans[130].block_m > plans[40].block_m > plans[5].block_m
    full = fp8_gemm(q, s, w, ws).cpu()
    in_tile = fp8_gemm(q, s, w, ws, workspace=False).cpu()  # each program sums its ranges
    assert torch.equal(in_tile.view(torch.int32), full.view(torch.int32))
    for m in (1, 5, 40):
        for r0 in (0, 130 - m):
            part = fp8_gemm(q[r0:r0 + m], s[r0:r0 + m], w, ws).cpu()
            assert torch.equal(part.view(torch.int32), full[r0:r0 + m].view(torch.int32)), (m, r0)


V41_GEMMS = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120),
             "wo_b": (5120, 8192), "index_wq_b": (4096, 1280)}  # (N, K): V4.1-Flash's fp8


def test_k_order_at_v41_shapes():
    """The plan alone (these shapes are too slow for the interpreter): one K order per weight
    for every M; at decode sizes the decode kernel runs the ranges as split-K programs that
    fill the SMs, on whole KSUB iterations; larger M keeps the partial-traffic cap and
    prefill-sized M sums the ranges in the tile."""
    sms = DEFAULT_SM_COUNT
    for name, (n, k) in V41_GEMMS.items():
        kb = k // 32
        plans = {m: T._gemm_plan(m, n, kb, sms) for m in (1, 8, 16, 17, 64, 65, 4096)}
        order = plans[1].order
        assert all(p.order == order for p in plans.values()), name  # never a function of M
        assert kb % order.granule == 0 and order.chunks >= order.ranges, name
        for m, plan in plans.items():
            assert order.granule % plan.ksub == 0, (name, m)
            assert plan.swap == (m <= T.SPLIT_MAX_M), (name, m)
            if plan.swap:  # decode: split whenever there is more than one range
                assert plan.workspace == (order.ranges > 1), (name, m)
            elif plan.workspace:  # fp32 partials written + read: a small share of the
                traffic = order.ranges * m * n * 8  # weights, or a few tens of us at most
                assert traffic * T.SPLIT_TRAFFIC_SHARE <= n * k \
                    or traffic <= T.SPLIT_PARTIAL_BYTES, (name, m)
        if -(-n // 64) >= T.SPLIT_PROGRAMS_PER_SM * sms:  # k_order's 64-wide tiles
            assert order.ranges == 1, name  # wq_b: 512 tiles fill the SMs already
        else:
            assert order.ranges > 1 and plans[1].workspace, name
            for m in (1, 8, 64):  # the decode tiles times the ranges fill the SMs
                assert -(-n // plans[m].block_n) * order.ranges >= sms, (name, m)
        assert plans[1].ksub * 32 >= 128, name  # contiguous bytes per weight row in flight
        assert not plans[4096].workspace, name
        # DIAG through TMA: 4 blocks a dot up to 4 token rows, 2 at 5-8 (a lane's 4 slots),
        # 4-block iterations, so the weight's scales are read a word at a time
        scale = torch.empty(n // 32, kb, dtype=torch.uint8)
        for m in range(1, T.DIAG_MAX_M + 1):
            diag = T._gemm_plan(m, n, kb, sms, tma=True)
            assert diag.diag == (4 if m <= 4 else 2) and diag.ksub == 4, (name, m)
            assert T._scale_words(diag, scale), (name, m)
    assert T._gemm_plan(1, 1280, 160, sms).splits > 1  # wq_a at M = 1, named
    wkv = T._gemm_plan(128, 512, 160, sms)  # 4 tiles of 128 rows: the ranges as programs
    assert wkv.splits == wkv.order.ranges > 1
    assert T._gemm_plan(8192, 512, 160, sms).splits == 1  # prefill-sized M: no partials
    assert T._gemm_plan(1, 1280, 160, sms).dot_f16  # precise_dot's default: fp16 operands
    assert not T._gemm_plan(1, 1280, 160, sms, precise_dot=False).dot_f16


DECODE_CASES = {  # id: (M, N, K, num_splits); N off BLOCK_N, M at the tile-row boundaries
    "m1-n37-kb5-auto": (1, 37, 160, None),  # granule 1: KSUB 1, one range per block
    "m16-n130-kb13-s3": (16, 130, 416, 3),  # the largest 16-row tile; ragged ranges
    "m17-n200-kb8-s2": (17, 200, 256, 2),  # the first 64-row tile; N over one 128-row tile
    "m64-n70-kb12-auto": (64, 70, 384, None),  # the largest decode M
    "m5-n129-kb3-s1": (5, 129, 96, 1),  # one range: the reference's K order
    # DIAG (TMA, <= DIAG_MAX_M rows): 4 blocks a dot over 4 token columns each, 2 over 8
    "m3-n100-kb16-s2": (3, 100, 512, 2),
    "m1-n70-kb16-s2": (1, 70, 512, 2),  # 8 blocks a dot where an iteration has 8
    "m8-n64-kb24-s3": (8, 64, 768, 3),
}


@pytest.mark.parametrize("diag_rows, diag_tiles", [(0, None), (8, None), (8, (64, 4, 3, 8))],
                         ids=["diag-off", "diag-8", "diag-8-ksub8"])
@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_kernel_equals_tile_kernel(case, diag_rows, diag_tiles, monkeypatch):
    """_fp8_decode_kernel (swapped operands) against _fp8_gemm_kernel on the same K order,
    split-K programs or one program summing the ranges, the weight through TMA descriptors or
    plain loads, DIAG's block dots in one dot at up to ``diag_rows`` rows or not: the same
    bits, every element written (NaN-poisoned outputs), signed zeros too. On an H200 both run
    wgmma; under the interpreter both are exact."""
    monkeypatch.setattr(T, "DIAG_MAX_M", diag_rows)
    if diag_tiles:  # 8 blocks an iteration: several dots an iteration past 2 rows
        monkeypatch.setattr(T, "_FP8_DIAG_TILES", diag_tiles)
    m, n, k, splits = DECODE_CASES[case]
    q, s, w, ws = _split_case(m, n, k, seed=m * 7 + n)
    if m > 1:  # a zero row: every block dot a sum of signed zeros (the outputs' signs compared)
        q[1].view(torch.uint8).zero_()
    w, ws = w.to(DEV), ws.to(DEV)
    sms = DEFAULT_SM_COUNT if DEV == "cpu" else sm_count(torch.device(DEV))
    outs = []
    for workspace, tma in ((None, False), (True, False), (False, False), (None, True),
                           (True, True), (False, True)):
        plan = T._gemm_plan(m, n, k // 32, sms, splits, workspace=workspace, tma=tma)
        # DIAG at <= DIAG_MAX_M rows through TMA: M's next power of two rows, the block dots
        # in one dot
        assert bool(plan.diag) == (tma and m <= T.DIAG_MAX_M)
        assert plan.swap and plan.block_m == (1 << (m - 1).bit_length() if plan.diag else
                                              16 if m <= 16 else 64)
        assert plan.tma == (tma and m <= 16)  # TMA weight loads: the 16-row tiles only
        assert T._tma_weight(w)  # so the kernel takes the descriptor path
        tile = dataclasses.replace(plan, swap=False, block_m=64, block_n=64, num_warps=4,
                                   num_stages=3, tma=False)
        for p in (plan, tile):
            out = torch.full((m, n), float("nan"), device=DEV)
            T._run_fp8_gemm(p, q, s, w, ws, out)
            assert not torch.isnan(out).any(), (workspace, p.swap)
            outs.append(out.cpu().view(torch.int32))
    for other in outs[1:]:
        assert torch.equal(outs[0], other)
    if splits == 1 and interpreting():
        assert torch.equal(outs[0].view(torch.float32), ref_gemm(q.cpu().float(), s.cpu(),
                                                                  w.cpu(), ws.cpu()))


def test_decode_weight_without_tma_alignment():
    """A weight whose address is not 16-byte aligned cannot have a TMA descriptor: the decode
    kernel reads it with plain loads, same bits as the aligned copy (which takes TMA)."""
    n, k = 96, 32 * 12
    w, ws = _quantized(n, k, seed=5)
    buf = torch.empty(n * k + 1, dtype=torch.uint8, device=DEV)
    odd = buf[1:].view(torch.float8_e4m3fn).view(n, k)
    odd.copy_(w.to(DEV))
    w, ws = w.to(DEV), ws.to(DEV)
    assert T._tma_weight(w) and not T._tma_weight(odd)
    assert not T._tma_weight(w.t().contiguous().t())  # not contiguous
    for m in (1, 5, 16):
        x = torch.randn(m, k, device=DEV).bfloat16()
        want = fp8_linear(x, w, ws).view(torch.int16)
        assert torch.equal(fp8_linear(x, odd, ws).view(torch.int16), want), m


def test_decode_boundary_rows_alone():
    """M = 16 / 17 (16- to 64-row decode tiles) and 64 / 65 (decode kernel to
    _fp8_gemm_kernel): each row has the bits it has in the larger call."""
    n, k = 96, 256
    q, s, w, ws = _split_case(65, n, k, seed=11)
    w, ws = w.to(DEV), ws.to(DEV)
    full = fp8_gemm(q, s, w, ws).cpu().view(torch.int32)
    for m in (16, 17, 64):
        for r0 in (0, 65 - m):
            part = fp8_gemm(q[r0:r0 + m], s[r0:r0 + m], w, ws).cpu().view(torch.int32)
            assert torch.equal(part, full[r0:r0 + m]), (m, r0)


def test_act_quant_f16_values():
    """act_quant(f16=True): the e4m3 codes' values as fp16, exactly (signed zeros, subnormals,
    448), and the same scales."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(5, 32 * 9, generator=g) * torch.logspace(-8, 8, 5)[:, None]
    x[0, :32] = torch.cat([_e4m3_grid()[:16], -_e4m3_grid()[:16]]) * 2.0 ** -3  # tiny codes
    x[1, 40] = -0.0
    x[2, 64:96] = 0.0
    x = x.bfloat16().to(DEV)
    q, s = act_quant(x)
    v, s16 = act_quant(x, f16=True)
    assert v.dtype == torch.float16 and torch.equal(s16, s)
    assert torch.equal(v.cpu().view(torch.int16), q.cpu().to(torch.float16).view(torch.int16))


def test_act_quant_dequant_values():
    """act_quant(dequant=True): each code's value times its block's scale, as bf16, exactly
    (signed zeros, e4m3 subnormals, 448, scales from 2^-23 up), and the same scales."""
    g = torch.Generator().manual_seed(22)
    x = torch.randn(6, 32 * 9, generator=g) * torch.logspace(-30, 30, 6)[:, None]
    x[0, :32] = torch.cat([_e4m3_grid()[:16], -_e4m3_grid()[:16]]) * 2.0 ** -3  # tiny codes
    x[1, 40] = -0.0
    x[2, 64:96] = 0.0  # amax floored: the smallest scale
    x[3, :32] = 3.0e38
    x = x.bfloat16().to(DEV)
    q, s = act_quant(x)
    v, sv = act_quant(x, dequant=True)
    assert v.dtype == torch.bfloat16 and torch.equal(sv, s)
    want = q.cpu().float() * s.cpu().repeat_interleave(32, 1)
    assert torch.equal(v.cpu().float(), want)  # exact: bf16 holds every product
    signs = q.cpu().view(torch.uint8) >= 128
    assert torch.equal(torch.signbit(v.cpu().float()), signs)  # -0 codes stay -0
    with pytest.raises(ValueError, match="exclusive"):
        act_quant(x, f16=True, dequant=True)


def test_e4m3_to_bf16_every_code():
    """The square tiles' weight operand: every e4m3 byte (both zeros, subnormals, +-448, NaN)
    widened to bf16 as torch's cast does, over a length that ends mid-program (8192 + 2 * 256 +
    5 elements); a wrong dtype is refused."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w = torch.cat([codes.repeat(34), codes[:5]]).view(torch.float8_e4m3fn).reshape(1, -1)
    got = T.e4m3_to_bf16(w.to(DEV)).cpu()
    want = w.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == w.shape
    nan = torch.isnan(want)
    assert nan.sum() == 2 * 34 + 0 and torch.equal(torch.isnan(got), nan)  # 0x7F, 0xFF
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))  # -0 kept
    assert T.e4m3_to_bf16(w[:, :0].to(DEV)).shape == (1, 0)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        T.e4m3_to_bf16(want.to(DEV))


PRESCALED_CASES = {  # id: (M, N, K, num_splits): past SPLIT_MAX_M, N off the 128-wide tile
    "m65-n100-kb24-auto": (65, 100, 768, None),  # k_order's ranges, summed in the tile
    "m130-n70-kb13-s5": (130, 70, 416, 5),  # two row tiles; ragged ranges of 1-block chunks
    "m70-n37-kb5-s1": (70, 37, 160, 1),  # one range: the reference's K order
    "m520-n37-kb5-auto": (520, 37, 160, None),  # fp8_linear's own PRESCALED rows and tiles
}


@pytest.mark.parametrize("case", list(PRESCALED_CASES), ids=list(PRESCALED_CASES))
def test_prescaled_kernel_equals_code_kernel(case):
    """_fp8_gemm_kernel on bf16 values (x's codes times their scales, the weight's values:
    PRESCALED, what fp8_linear runs from PRESCALE_MIN_M rows) against the same kernel on the e4m3
    codes and scales, split-K programs or one program summing the ranges: the same bits,
    every element written (NaN-poisoned outputs); and fp8_linear's rows alone (the decode
    kernel) equal them."""
    m, n, k, splits = PRESCALED_CASES[case]
    q, s, w, ws = _split_case(m, n, k, seed=m + n)
    w, ws = w.to(DEV), ws.to(DEV)
    v, _ = act_quant(_split_x(m, k, seed=m + n).to(DEV), dequant=True)
    sms = DEFAULT_SM_COUNT if DEV == "cpu" else sm_count(torch.device(DEV))
    want = fp8_gemm(q, s, w, ws, num_splits=splits).cpu().view(torch.int32)
    want_bf16 = want.view(torch.float32).to(torch.bfloat16).view(torch.int16)
    for workspace in (None, True, False):
        plan = T._gemm_plan(m, n, k // 32, sms, splits, workspace=workspace, values=True,
                            tma=DEV == "cpu" or T._tma_weight(w))
        assert plan.prescaled and not plan.swap and plan.tma == T.SQUARE_TMA
        for tma, dt in itertools.product((False, True), (torch.float32, torch.bfloat16)):
            run = dataclasses.replace(plan, tma=tma)
            out = torch.full((m, n), float("nan"), dtype=dt, device=DEV)
            T._run_fp8_gemm(run, v, s, w.to(torch.bfloat16), ws, out)
            got = out.cpu().view(torch.int32 if dt == torch.float32 else torch.int16)
            assert torch.equal(got, want if dt == torch.float32 else want_bf16), (workspace, tma)
    assert not T._gemm_plan(m, n, k // 32, sms, splits, values=True, precise_dot=False).prescaled
    decode = T._gemm_plan(64, n, k // 32, sms, splits, values=True)  # the decode kernel's
    assert decode.swap and decode.prescaled  # VALUES: x's values, the weight's e4m3 codes
    x = _split_x(m, k, seed=m + n).to(DEV)
    y = fp8_linear(x, w, ws, num_splits=splits, out_dtype=torch.float32).cpu().view(torch.int32)
    assert torch.equal(y, want)
    for r0, rows in ((0, 1), (m - 17, 17)):  # the decode kernel's 16- and 64-row tiles
        alone = fp8_linear(x[r0:r0 + rows], w, ws, num_splits=splits, out_dtype=torch.float32)
        assert torch.equal(alone.cpu().view(torch.int32), want[r0:r0 + rows]), rows


VALUES_CASES = {  # id: (M, N, K, num_splits): N and M off every tile
    "m17-n200-kb8-s2": (17, 200, 256, 2),  # the first row past the 16-row tiles
    "m40-n70-kb13-auto": (40, 70, 416, None),  # k_order's ranges: 1-block chunks, KSUB 1
    "m130-n100-kb12-s3": (130, 100, 384, 3),  # past SPLIT_MAX_M: two wide tiles of 64 rows
}


@pytest.mark.parametrize("case", list(VALUES_CASES), ids=list(VALUES_CASES))
def test_decode_kernel_on_values(case):
    """_fp8_decode_kernel on act_quant's bf16 values (VALUES: each block dot comes out times
    the row scale) in each tile fp8_linear runs past 16 rows (the 64-row plain tiles, every
    wide TMA tile), split-K programs (the last program's sum) or one program summing the
    ranges: the bits of fp8_gemm on the e4m3 codes, every element written (NaN-poisoned);
    and fp8_linear's own rows."""
    m, n, k, splits = VALUES_CASES[case]
    q, s, w, ws = _split_case(m, n, k, seed=m + 3 * n)
    w, ws = w.to(DEV), ws.to(DEV)
    x = _split_x(m, k, seed=m + 3 * n).to(DEV)
    v, sv = act_quant(x, dequant=True)
    want = fp8_gemm(q, s, w, ws, num_splits=splits).cpu().view(torch.int32)
    sms = DEFAULT_SM_COUNT if DEV == "cpu" else sm_count(torch.device(DEV))
    tiles = [row[1:] + (False,) for row in T._FP8_DECODE_TILES[1:]] + \
        [row[1:] + (True,) for row in T._FP8_WIDE_TILES + T._FP8_WIDE_SMALL_TILES
         + T._FP8_WIDE_TALL_TILES]
    for workspace in (True, False):
        base = T._gemm_plan(min(m, T.SPLIT_MAX_M), n, k // 32, sms, splits,
                            workspace=workspace, values=True)
        assert base.swap and base.prescaled
        assert base.workspace == (workspace and base.order.ranges > 1)
        for bm, bn, warps, stages, _, tma in tiles:
            plan = dataclasses.replace(base, block_m=bm, block_n=bn, num_warps=warps,
                                       num_stages=stages, tma=tma)
            for dt in (torch.float32, torch.bfloat16):
                out = torch.full((m, n), float("nan"), dtype=dt, device=DEV)
                T._run_fp8_gemm(plan, v, sv, w, ws, out)
                got = out.cpu()
                if dt == torch.float32:
                    assert torch.equal(got.view(torch.int32), want), (workspace, bm, bn, tma)
                else:
                    assert torch.equal(got.view(torch.int16), want.view(torch.float32).to(
                        torch.bfloat16).view(torch.int16)), (workspace, bm, bn, tma)
    for buf in T._COUNTERS.values():
        assert not buf.any()
    y = fp8_linear(x, w, ws, num_splits=splits, out_dtype=torch.float32).cpu().view(torch.int32)
    assert torch.equal(y, want)


def test_wide_tiles_at_v41_shapes():
    """The plan fp8_linear takes for V4.1-Flash's fp8 weights (a TMA-readable weight; 132 SMs):
    fp16 values into the 16-row tiles at <= 16 rows; bf16 values into the decode kernel past
    them (the 64-row plain tiles, or the wide TMA tiles for wq_b and wo_b); at 65-511 rows the
    wide tiles for wq_b and wo_b, and for a smaller weight only where the square tiles would
    leave SMs idle with K unsplit; the square tiles on bf16 values from PRESCALE_MIN_M. One K
    order per weight throughout."""
    sms = DEFAULT_SM_COUNT
    # (wkv's 40 ranges split on the square tiles up to 614 rows: SPLIT_PARTIAL_BYTES)
    wide_small = {"wq_a": (511,), "index_wq_b": (256, 384, 511)}
    for name, (n, k) in V41_GEMMS.items():
        kb = k // 32
        large = n * k >= T.WIDE_MIN_BYTES
        assert large == (name in ("wq_b", "wo_b")), name
        orders = set()
        for m in (1, 16, 17, 32, 33, 64, 65, 128, 256, 384, 511, 512, 4096):
            plan = T._linear_shape_plan(m, n, kb, sms, None, True, tma=True)
            orders.add(plan.order)
            form = T._x_form(plan)
            if m <= 16:
                assert plan.swap and plan.tma and form == "f16", (name, m)
            elif m <= T.SPLIT_MAX_M:
                assert plan.swap and form == "values" and plan.tma == large, (name, m)
            elif m < T.PRESCALE_MIN_M:
                wide = large or m in wide_small.get(name, ())
                assert plan.swap == wide == plan.tma, (name, m)
                assert form == ("values" if wide else "codes"), (name, m)
            else:
                assert not plan.swap and form == "values", (name, m)
            if plan.swap and m > 16:
                assert plan.block_m == (32 if m <= 32 and large else 128 if m > 64 and large
                                        else 64), (name, m)
                # 33-64 rows: 128 weight rows on 8 warps where those tiles fill the SMs (wq_b)
                tall = 32 < m <= T.SPLIT_MAX_M and name == "wq_b"
                assert (plan.block_n, plan.num_warps) == ((128, 8) if tall else
                                                          (plan.block_n, 4)), (name, m)
        assert len(orders) == 1, name


def test_swap_split_by_rounds(monkeypatch):
    """The Gluon swapped tiles' split rule (_swap_split) at wo_b's shape (40 weight tiles of
    128 rows, 5 ranges) on 132 SMs: split while the tiles leave SMs idle (384 rows: 120
    tiles); at 448 rows (160 tiles, 2 rounds of whole-K tiles) split only with
    SWAP_SPLIT_ROUNDS (800 items: 7 rounds of a fifth of K); one range never splits."""
    tiles = {m: 40 * -(-m // 128) for m in (256, 384, 448, 511, 1024)}
    monkeypatch.setattr(T, "SWAP_SPLIT_ROUNDS", False)
    assert [T._swap_split(tiles[m], 5, 132) for m in tiles] == [True, True, False, False, False]
    monkeypatch.setattr(T, "SWAP_SPLIT_ROUNDS", True)
    assert [T._swap_split(tiles[m], 5, 132) for m in tiles] == [True, True, True, True, True]
    assert not T._swap_split(160, 1, 132) and not T._swap_split(10, 1, 132)
    assert not T._swap_split(264, 5, 132)  # whole rounds already: 2 either way
    assert T._swap_split(133, 2, 132) and not T._swap_split(199, 2, 132)


PAIR_CASES = {"m1": 1, "m7": 7, "m16": 16, "m17": 17, "m70": 70}


@pytest.mark.parametrize("m", list(PAIR_CASES.values()), ids=list(PAIR_CASES))
def test_fp8_linear_pair_equals_two_calls(m):
    """fp8_linear_pair (one act_quant for two weights of the same K, N off the tiles): the
    bits of two fp8_linear calls, bf16 and fp32 out."""
    k = 32 * 12
    w1, s1 = _quantized(70, k, seed=m)
    w2, s2 = _quantized(33, k, seed=m + 1)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 2).bfloat16().to(DEV)
    w1, s1, w2, s2 = w1.to(DEV), s1.to(DEV), w2.to(DEV), s2.to(DEV)
    for dt in (torch.bfloat16, torch.float32):
        y1, y2 = T.fp8_linear_pair(x, w1, s1, w2, s2, out_dtype=dt)
        r1 = fp8_linear(x, w1, s1, out_dtype=dt)
        r2 = fp8_linear(x, w2, s2, out_dtype=dt)
        assert y1.dtype == dt and y1.shape == (m, 70) and y2.shape == (m, 33)
        assert torch.equal(y1.cpu().float(), r1.cpu().float())
        assert torch.equal(y2.cpu().float(), r2.cpu().float())
    with pytest.raises(ValueError):
        T.fp8_linear_pair(x, w1, s1, w2[:, :32].contiguous(), s2[:, :1].contiguous())


@pytest.mark.parametrize("kb", [45, 160, 7], ids=["kb45-one-program", "kb160-three", "kb7"])
def test_act_quant_wide_programs_same_bits(kb, monkeypatch):
    """From QUANT_WIDE_MIN_M rows a program quantises up to QUANT_BLOCKS_WIDE blocks (masked
    past the row's end): every form and the scales are the bits of the 16-block programs and
    of the reference, with and without the fused RMSNorm; a NaN and an infinity mark their
    blocks (and, through the norm, their rows) in both the same way."""
    g = torch.Generator().manual_seed(kb)
    k = 32 * kb
    x = (torch.randn(8, k, generator=g) * torch.logspace(-8, 8, 8)[:, None]).bfloat16()
    x[6, k // 2], x[7, k - 1] = float("nan"), float("-inf")
    x = x.to(DEV)
    w = (torch.randn(k, generator=g) * 0.5 + 1).bfloat16().to(DEV)
    narrow = {}
    for wide in (False, True):
        monkeypatch.setattr(T, "QUANT_WIDE_MIN_M", 1 if wide else 1 << 30)
        for norm in (None, (w, 1e-6)):
            for kw in ({}, {"f16": True}, {"dequant": True}):
                q, s = act_quant(x, norm=norm, **kw)
                key = (norm is None, tuple(kw))
                if not wide:
                    narrow[key] = (q, s)
                    continue
                q0, s0 = narrow[key]
                assert torch.equal(bytes_of(s), bytes_of(s0))
                assert torch.equal(bytes_of(q), bytes_of(q0))
    _check_quant(x[:6].cpu())


@pytest.mark.parametrize("k", [1024, 2560], ids=["k1024-4warps", "k2560-8warps"])
def test_act_quant_with_norm_equals_rms_norm_first(k):
    """act_quant's fused RMSNorm (the query's q_norm inside wq_b's act-quant): every form
    (e4m3 codes, fp16 values, bf16 values) and the scales equal act_quant of
    common.triton.rms_norm's output, bit for bit; rows spanning 2^-20 .. 2^20, a zero row."""
    from dsv41attn.ops.common.triton import rms_norm

    g = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=g) * torch.logspace(-6, 6, 5, base=10.0)[:, None]
    x[2] = 0.0
    x = x.bfloat16().to(DEV)
    w = (torch.randn(k, generator=g) * 0.5 + 1).bfloat16().to(DEV)
    normed = rms_norm(x, w, 1e-6)
    for kw in ({}, {"f16": True}, {"dequant": True}):
        want = act_quant(normed, **kw)
        got = act_quant(x, norm=(w, 1e-6), **kw)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.cpu().view(torch.uint8),
                                                      b.cpu().view(torch.uint8)), kw
    with pytest.raises(ValueError, match="norm weight"):
        act_quant(x, norm=(w[:-32], 1e-6))
    with pytest.raises(ValueError, match="norm weight"):
        act_quant(x, norm=(w.float(), 1e-6))


@pytest.mark.parametrize("m", [1, 17, 70])
def test_fp8_linear_with_norm_equals_norm_first(m):
    """fp8_linear and fp8_linear_pair with norm=(weight, eps) (the layer's q_norm then wq_b
    and the index wq_b): the bits of rms_norm then the linears, on both backends."""
    from dsv41attn.ops.common.norm import rms_norm as ref_rms_norm
    from dsv41attn.ops.common.triton import rms_norm
    from dsv41attn.ops.linear import reference as R

    k = 32 * 12
    w1, s1 = _quantized(70, k, seed=m)
    w2, s2 = _quantized(33, k, seed=m + 1)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    nw = (torch.randn(k, generator=g) * 0.5 + 1).bfloat16()
    xd, nwd = x.to(DEV), nw.to(DEV)
    w1d, s1d, w2d, s2d = w1.to(DEV), s1.to(DEV), w2.to(DEV), s2.to(DEV)
    normed = rms_norm(xd, nwd, 1e-6)
    y = fp8_linear(xd, w1d, s1d, norm=(nwd, 1e-6))
    assert torch.equal(y.cpu(), fp8_linear(normed, w1d, s1d).cpu())
    y1, y2 = T.fp8_linear_pair(xd, w1d, s1d, w2d, s2d, norm=(nwd, 1e-6))
    assert torch.equal(y1.cpu(), fp8_linear(normed, w1d, s1d).cpu())
    assert torch.equal(y2.cpu(), fp8_linear(normed, w2d, s2d).cpu())
    ref_normed = ref_rms_norm(x, nw, 1e-6)
    assert torch.equal(R.fp8_linear(x, w1, s1, norm=(nw, 1e-6)), R.fp8_linear(ref_normed, w1, s1))
    r1, r2 = R.fp8_linear_pair(x, w1, s1, w2, s2, norm=(nw, 1e-6))
    assert torch.equal(r1, R.fp8_linear(ref_normed, w1, s1))
    assert torch.equal(r2, R.fp8_linear(ref_normed, w2, s2))


ROPE_CASES = {  # id: (M, N, head_dim D, R/2, num_splits): where the RoPE is applied
    "m1-split-sum-in-kernel": (1, 256, 64, 16, None),  # 16-row tiles, last program's sum
    "m5-unsplit": (5, 200, 100, 7, 1),  # one range: the unsplit store; D off the tiles
    "m16-two-heads-a-tile": (16, 512, 64, 32, None),  # a 128-row tile spans heads
    "m2-tiles-without-tail": (2, 512, 512, 16, 1),  # V4.1's head: 3 of 4 tiles hold no tail
    "m17-64-row-tiles": (17, 256, 128, 32, None),  # bf16 values; split sum by its own kernel
    "m40-unsplit": (40, 256, 64, 1, 1),  # one pair a head, 64-row tiles written directly
    "m70-square": (70, 192, 64, 8, None),  # square tiles, split-K programs: rope_heads after
    "m70-square-unsplit": (70, 192, 64, 8, 1),  # the square tiles' epilogue turns the tails
    "m520-square-values": (520, 256, 128, 32, 1),  # PRESCALED square tiles (TMA), rope stored
}


@pytest.mark.parametrize("case", list(ROPE_CASES), ids=list(ROPE_CASES))
def test_fp8_linear_rope_equals_rope_after(case, monkeypatch):
    """fp8_linear(rope=(rot, D)) (the query's RoPE in wq_b's epilogue where the decode kernel
    writes the output, else rope_heads in place after): the bits of rope_heads on the plain
    output at every tile and split form, the output NaN-poisoned first (every element
    written); fp8_linear_pair turns its first output only; the reference's rope= is its
    apply_rope after the linear."""
    from dsv41attn.ops.common.triton import rope_heads
    from dsv41attn.ops.linear import reference as R
    from dsv41attn.ops.window_kv.reference import rope_heads as ref_rope_heads

    m, n, d, r2, splits = ROPE_CASES[case]
    k = 32 * 10
    w, ws = _quantized(n, k, seed=m + n)
    w2, s2 = _quantized(33, k, seed=m + 1)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    ang = torch.rand(m, r2, generator=g) * 50
    rot = torch.polar(torch.ones_like(ang), ang)
    xd, wd, wsd, rotd = x.to(DEV), w.to(DEV), ws.to(DEV), rot.to(DEV)
    plain = fp8_linear(xd, wd, wsd, num_splits=splits)
    want = rope_heads(plain.view(m, n // d, d), rotd).view(m, n)
    poison_empty(monkeypatch, T)  # every buffer the op makes starts NaN
    got = fp8_linear(xd, wd, wsd, num_splits=splits, rope=(rotd, d))
    monkeypatch.undo()
    assert torch.equal(got.cpu().view(torch.int16), want.cpu().view(torch.int16))
    plan = T._linear_plan(m, wd, splits, True, xd.device)
    assert plan.writes_out == (case not in ("m70-square", "m17-64-row-tiles")), plan
    assert plan.swap == (m <= T.SPLIT_MAX_M)
    assert plan.swap or plan.prescaled == (m >= T.PRESCALE_MIN_M)
    y1, y2 = T.fp8_linear_pair(xd, wd, wsd, w2.to(DEV), s2.to(DEV), rope=(rotd, d))
    assert torch.equal(y1.cpu().view(torch.int16), fp8_linear(xd, wd, wsd, rope=(rotd, d))
                       .cpu().view(torch.int16))
    assert torch.equal(y2.cpu(), fp8_linear(xd, w2.to(DEV), s2.to(DEV)).cpu())
    ref = R.fp8_linear(x, w, ws, rope=(rot, d))
    assert torch.equal(ref, ref_rope_heads(R.fp8_linear(x, w, ws).view(m, n // d, d), rot)
                       .view(m, n))
    r1, _ = R.fp8_linear_pair(x, w, ws, w2, s2, rope=(rot, d))
    assert torch.equal(r1, ref)


def test_fp8_linear_rope_bad_inputs():
    """rope's argument errors on both backends, before anything runs."""
    from dsv41attn.ops.linear import reference as R

    w, ws = _quantized(128, 64, seed=5)
    x = torch.randn(3, 64).bfloat16()
    rot = torch.polar(torch.ones(3, 8), torch.rand(3, 8))
    for fn in (R.fp8_linear, fp8_linear):
        with pytest.raises(ValueError, match="pair"):
            fn(x, w, ws, rope=rot)
        with pytest.raises(ValueError, match="head_dim"):
            fn(x, w, ws, rope=(rot, 48))  # does not divide 128
        with pytest.raises(ValueError, match="head_dim"):
            fn(x, w, ws, rope=(rot, True))
        with pytest.raises(ValueError, match="rot"):
            fn(x, w, ws, rope=(rot[:2], 64))  # rows
        with pytest.raises(ValueError, match="rot"):
            fn(x, w, ws, rope=(torch.polar(torch.ones(3, 40), torch.rand(3, 40)), 64))  # R > D
        with pytest.raises(ValueError, match="rot"):
            fn(x, w, ws, rope=(rot.real, 64))
        with pytest.raises(ValueError, match="bf16"):
            fn(x, w, ws, rope=(rot, 64), out_dtype=torch.float32)


@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 65])
def test_linear_outputs_equal_gemm(m):
    """fp8_linear's own epilogues (bf16 or fp32 written by the decode kernel, the fused
    split-K sum at <= 16 rows, fp16 token values) against fp8_gemm on the e4m3 codes then
    torch's cast: the same bits; fp16 values into fp8_gemm too (decode and tile kernels); the
    fused sum leaves its tile counters at zero."""
    n, k = 100, 32 * 24
    w, ws = _quantized(n, k, seed=m + 40)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k // 32).repeat_interleave(32))
    x = x.bfloat16().to(DEV)
    w, ws = w.to(DEV), ws.to(DEV)
    q, s = act_quant(x)
    ref = fp8_gemm(q, s, w, ws)
    plan = T._gemm_plan(m, n, k // 32, DEFAULT_SM_COUNT if DEV == "cpu" else
                        sm_count(torch.device(DEV)))
    assert plan.order.ranges > 1
    v, _ = act_quant(x, f16=True)
    for splits in (None, 1, 5):
        r = fp8_gemm(q, s, w, ws, num_splits=splits)
        y16 = fp8_gemm(v, s, w, ws, num_splits=splits)
        assert torch.equal(y16.cpu().view(torch.int32), r.cpu().view(torch.int32)), splits
        yb = fp8_linear(x, w, ws, num_splits=splits)
        yf = fp8_linear(x, w, ws, num_splits=splits, out_dtype=torch.float32)
        assert torch.equal(yf.cpu().view(torch.int32), r.cpu().view(torch.int32)), splits
        assert torch.equal(yb.cpu().view(torch.int16), r.to(torch.bfloat16).cpu().view(torch.int16))
    assert torch.equal(fp8_gemm(q, s, w, ws).cpu().view(torch.int32), ref.cpu().view(torch.int32))
    for buf in T._COUNTERS.values():
        assert not buf.any()
    with pytest.raises(ValueError, match="precise_dot"):
        fp8_gemm(v, s, w, ws, precise_dot=False)


def test_capture_counter_pool_hands_out_each_counter_once():
    """The counters of captured launches: disjoint zeroed slices, in order, until the buffer
    is spent (then None: the capture zeroes a buffer of its own); top_up (eager launches)
    starts a new buffer once less than half is left, leaving the slices handed out alone."""
    pool = T._CounterPool("cpu", 10)
    assert pool.take(1) is None  # nothing allocated before an eager launch
    pool.top_up()
    a, b = pool.take(4), pool.take(1)
    first = pool.buffer
    pool.top_up()  # 5 of 10 left: the same buffer
    assert pool.buffer is first
    c = pool.take(5)
    assert all(t.numel() == n and (t == 0).all() for t, n in ((a, 4), (b, 1), (c, 5)))
    a.fill_(1)
    assert (b == 0).all() and (c == 0).all() and pool.take(1) is None
    assert b.data_ptr() == a.data_ptr() + 4 * a.element_size()
    assert c.data_ptr() == b.data_ptr() + b.element_size()
    pool.top_up()  # spent: a new buffer; the old slices stay as they are
    d = pool.take(10)
    assert pool.buffer is not first and d.numel() == 10 and (d == 0).all()
    assert (a == 1).all() and pool.used == 20 and pool.take(1) is None
    # the spent buffer is kept: a graph holds only its slices' addresses
    assert len(pool.buffers) == 2 and pool.buffers[0] is first


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs")
def test_fused_split_sum_in_graphs_replayed_side_by_side():
    """Graphs with the decode kernel's in-kernel split-K sum (<= 16 rows) each own their tile
    counters (slices of the capture counter pool, which the eager warm-up made): two graphs
    captured on torch's shared capture stream, replayed at the same time on two streams, give
    the eager bits every time."""
    n, k = 4096, 32 * 160
    w, ws = _quantized(n, k, seed=91)
    w, ws = w.to(DEV), ws.to(DEV)
    xs = [torch.randn(m, k, device=DEV).bfloat16() for m in (1, 16)]
    want = [fp8_linear(x, w, ws) for x in xs]
    assert T._gemm_plan(1, n, k // 32, sm_count(torch.device(DEV))).splits > 1  # fused sum
    outs, graphs = [], []
    for x in xs:
        fp8_linear(x, w, ws)  # warm-up: compiled
        g = torch.cuda.CUDAGraph()
        used = T._CAPTURE_COUNTERS[str(w.device)].used
        with torch.cuda.graph(g):
            outs.append(fp8_linear(x, w, ws))
        assert T._CAPTURE_COUNTERS[str(w.device)].used > used  # the pool's, not a memset's
        graphs.append(g)
    streams = [torch.cuda.Stream() for _ in graphs]
    for _ in range(20):
        for g, st in zip(graphs, streams):
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                g.replay()
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        torch.cuda.synchronize()
        for got, ref in zip(outs, want):
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
