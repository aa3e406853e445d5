"""The warp-specialized Gluon sparse attention (ops/sparse_attn/gluon.py).

Gluon kernels do not run under TRITON_INTERPRET=1 (a Gluon launch needs a GPU driver), so on
the CPU the kernel is only compiled for sm_90a (the stand-in driver of sm90_compile.py) at the
shapes it would run; on a GPU it is checked against the reference op and the Triton kernel."""
import os

import pytest
import torch

pytest.importorskip("triton")

import sm90_compile  # noqa: E402
from test_sparse_attn_triton import make_step  # noqa: E402

from dsv41attn.ops.sparse_attn.reference import sparse_attn_paged as ref_paged  # noqa: E402

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 \
    and os.environ.get("TRITON_INTERPRET", "0") != "1"

# (D, stages): the model's head dim and a small one
SHAPES = [(512, 2), (128, 3), (256, 2)]


def _compile(d: int, stages: int, split: bool, persist: bool = True,
             triton_dir: str | None = None) -> dict:
    """Compile _sparse_attn_ws_kernel for sm_90a in a fresh process (the stand-in driver must not
    touch this process's Triton); its shared memory and (registers, stack, local ld/st, loop).
    triton_dir: another Triton first on the path (sm90_compile.TRITONS)."""
    return sm90_compile.compile_probe(rf"""import re
import dsv41attn.ops.sparse_attn.gluon as g
k = g._sparse_attn_ws_kernel.warmup(M(torch.bfloat16), M(torch.float32), M(torch.uint8),
    M(torch.uint8), M(torch.int32), M(torch.uint8), M(torch.int64), M(torch.int64),
    M(torch.int32), M(torch.bfloat16), M(torch.float32), M(torch.float32), 0.05, 64, 1000, 8,
    128, 512, 64, 256, 2 if {split} else 1, 4, 128, 512, 64, D={d}, PAGE_SHIFT=8,
    STAGES={stages}, RS=g.ROWS_PER_STORE, SUB=g.SUB_ROWS, RAW=g.RAW_STAGES, SPLIT={split},
    PERSIST={persist}, PRODUCER_REGS=g.PRODUCER_REGS, num_warps=8, grid=(1,))
ptx = k.asm["ptx"]
sass = s._sass(k.asm["cubin"])
part, size = None, {{}}  # SASS instructions by the partition's setmaxnreg register count
for line in sass.splitlines():
    m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
    if m:
        a = re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0x([0-9a-f]+)", m[1])
        part = int(a[1], 16) if a else part
        size[part] = size.get(part, 0) + 1
print(json.dumps({{"shared": int(k.metadata.shared), "res": s._resources(k.asm["cubin"], True),
                  "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": ptx.count("setmaxnreg"),
                  "mbarrier": ptx.count("mbarrier.try_wait"),
                  "producer": size.get(g.PRODUCER_REGS, 0)}}))
""", triton_dir)


@pytest.mark.parametrize("triton_dir", sm90_compile.TRITONS,
                         ids=lambda v: "this" if v is None else os.path.basename(v))
@pytest.mark.parametrize("d,stages,split,persist", [(512, 2, True, True), (512, 2, False, False),
                                                   (512, 2, False, True), (128, 3, False, True)])
def test_compiles_warp_specialized_for_sm90(d, stages, split, persist, triton_dir):
    """The kernel lowers for an H100/H200 under this Triton and the GPU image's, a program
    taking one item or several: async wgmmas, mbarrier hand-overs between the partitions,
    register budgets per partition, and shared memory within a block's 227 KB and within what
    the host checks (smem_bytes)."""
    pytest.importorskip("triton.experimental.gluon")
    from dsv41attn.ops.sparse_attn.gluon import smem_bytes
    r = _compile(d, stages, split, persist, triton_dir=triton_dir)
    assert r["shared"] <= 232448, r
    assert r["shared"] <= smem_bytes(d, stages), r
    assert r["wgmma"] > 0 and r["setmaxnreg"] > 0 and r["mbarrier"] > 0, r
    # the producer's code within the instruction cache: unrolled over a block's sub-blocks it
    # was 6388 instructions (102 KB) at D = 512, and its warps stalled on instruction fetch
    # more than on anything else (Nsight Compute); as a loop, 2283-2416; with its async copies
    # in their own layout (each thread's from one list entry), 1493-1592
    assert 0 < r["producer"] <= 2048, r


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
@pytest.mark.parametrize("d,stages", SHAPES)
@pytest.mark.parametrize("t,h,ww,k,page_rows", [
    (7, 64, 128, 0, 4),  # SWA: window only
    (5, 17, 70, 0, 4),  # padded heads, a block cut by the list's end
    (3, 64, 1, 0, 4),
    (4, 64, 0, 0, 4),  # empty lists
    (7, 64, 128, 200, 8),  # window then compressed rows, the pages a power of two
    (5, 64, 70, 130, 6),  # a block of both kinds; page and row by division
    (3, 64, 0, 65, 8),  # compressed only
])
def test_matches_reference_and_triton_kernel(t, h, d, stages, ww, k, page_rows):
    """Lists with holes, pads and a token with no entries (make_step): the Gluon kernel
    against the reference op, within twice the Triton kernel's own distance to it, and beside
    the Triton kernel (the same rounding points; only the row sums of p may add in another
    order)."""
    from dsv41attn.ops.sparse_attn.gluon import sparse_attn_paged_ws
    from dsv41attn.ops.sparse_attn.triton import sparse_attn_paged as tri_paged
    q, sink, args = make_step(t, h, d, ww, k, page_rows, seed=d + ww + k)
    scale = d ** -0.5
    ref = ref_paged(q.cpu(), sink.cpu(), scale, **{n: v if v is None else v.cpu()
                                                    for n, v in args.items()})
    tri = tri_paged(q, sink, scale, **args, split_blocks=0, num_splits=1)
    glu = sparse_attn_paged_ws(q, sink, scale, **args, num_splits=1, stages=stages)
    torch.cuda.synchronize()
    assert not glu.isnan().any()
    assert not glu[t // 2].any(), "a token without entries gives 0"
    err_tri = (tri.float().cpu() - ref.float()).abs().max().item()
    err_glu = (glu.float().cpu() - ref.float()).abs().max().item()
    assert err_glu <= max(2 * err_tri, 1e-2), (err_glu, err_tri)
    differ = (glu != tri).sum().item()
    print(f"t={t} h={h} d={d} ww={ww} k={k} stages={stages}: {differ} of {glu.numel()} "
          f"outputs differ from the Triton kernel's; max err vs reference {err_glu:.2e} "
          f"(Triton {err_tri:.2e})")


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
@pytest.mark.parametrize("split_blocks", [1, 3, None, 0])
@pytest.mark.parametrize("t,ww,k,r2", [
    (7, 128, 200, 32),  # 6 blocks: splits of 1, 3 and 2 blocks, the last one shorter
    (4, 70, 130, 1),  # a block of both kinds cut between splits, one rotated pair
    (2, 0, 65, 0),  # compressed only, a split with one valid row
])
def test_splits_and_out_rot(t, ww, k, r2, split_blocks):
    """The list split into programs of split_blocks 64-blocks (None: the Triton kernel's
    fixed cut; 0: sized to the step) and merged by the Triton kernel's merge, which also turns
    out_rot back: within the unsplit kernel's error to the reference, every element written,
    the rotation as rope_heads' on the plain output (and none where r2 = 0)."""
    from dsv41attn.ops.common.triton import rope_heads
    from dsv41attn.ops.sparse_attn.gluon import sparse_attn_paged_ws
    d, h = 512, 64
    q, sink, args = make_step(t, h, d, ww, k, 8, seed=ww + k + r2)
    g = torch.Generator().manual_seed(r2)
    rot = torch.polar(torch.ones(t, r2), torch.rand(t, r2, generator=g) * 6.3).cuda() \
        if r2 else None
    ref = ref_paged(q.cpu(), sink.cpu(), d ** -0.5, **{n: v if v is None else v.cpu()
                                                      for n, v in args.items()})
    one = sparse_attn_paged_ws(q, sink, d ** -0.5, **args, num_splits=1)
    out = torch.full_like(q, float("nan"))
    got = sparse_attn_paged_ws(q, sink, d ** -0.5, **args, split_blocks=split_blocks, out=out,
                               out_rot=rot)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    plain = got if rot is None else rope_heads(got, rot)  # turned forward again
    err_one = (one.float().cpu() - ref.float()).abs().max().item()
    err = (plain.float().cpu() - ref.float()).abs().max().item()
    assert err <= max(2 * err_one, 1e-2), (err, err_one)
    if rot is not None:
        split_plain = sparse_attn_paged_ws(q, sink, d ** -0.5, **args, split_blocks=split_blocks)
        assert torch.equal(got, rope_heads(split_plain, rot, inverse=True))


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
@pytest.mark.parametrize("t,h,d,ww,k", [
    (9, 64, 512, 128, 0),  # window only: 2 blocks an item
    (7, 64, 512, 70, 130),  # a block of both kinds, a token with no entries
    (6, 17, 256, 128, 200),  # padded heads
    (5, 64, 128, 0, 65),  # compressed only
])
@pytest.mark.parametrize("cut", [{"num_splits": 1}, {"split_blocks": 1}, {"split_blocks": 3},
                                 {"num_splits": 4}])  # 4: splits past a short list's end
def test_programs_take_items_in_turn_with_the_same_bits(t, h, d, ww, k, cut):
    """A program takes the (token, split) items p, p + G, ... in turn, its ring and q running
    on from one item to the next: every G (one program for all; two or three, so that an item
    follows an item of another token or of the same token's other split; one an item) gives
    the same bits, unsplit and split, and every output element is written."""
    from dsv41attn.ops.sparse_attn.gluon import sparse_attn_paged_ws
    q, sink, args = make_step(t, h, d, ww, k, 8, seed=t + ww + k)
    want = sparse_attn_paged_ws(q, sink, 0.2, **args, **cut, programs=10 ** 6)  # one an item
    assert not want.isnan().any()
    for g in (1, 2, 3, None):
        out = torch.full_like(q, float("nan"))
        got = sparse_attn_paged_ws(q, sink, 0.2, **args, **cut, programs=g, out=out)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (g, cut)


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
def test_empty_step_gives_the_triton_kernels_bits():
    """No token with a list entry: the Gluon op's output is the Triton op's to the bit, the
    reference's rotated zeros (-0 where they are) with out_rot, +0 without."""
    from dsv41attn.ops.sparse_attn.gluon import sparse_attn_paged_ws
    from dsv41attn.ops.sparse_attn.triton import sparse_attn_paged as tri_paged
    q, sink, args = make_step(4, 64, 512, 0, 0, 4, seed=3)
    angles = torch.arange(4 * 32, dtype=torch.float32).view(4, 32) * 0.7  # every quadrant
    rot = torch.polar(torch.ones(4, 32), angles).cuda()
    for r in (rot, None):
        glu = sparse_attn_paged_ws(q, sink, 0.3, **args, out_rot=r)
        tri = tri_paged(q, sink, 0.3, **args, out_rot=r)
        assert torch.equal(glu.view(torch.int16), tri.view(torch.int16))
    assert (glu.view(torch.int16) == 0).all()


def _decode_probe():
    """A kernel of the producer's window decode alone: program p stages packed window rows
    [16p, 16p + 16) ([N, D + D/32] uint8) in a raw stage's shared memory and decodes them 8
    rows at a time as the producer does (_window_decode), bf16 [N, D] out."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    import dsv41attn.ops.sparse_attn.gluon as g

    @gluon.jit
    def probe(raw_ptr, out_ptr, D: gl.constexpr, SUB: gl.constexpr, RS: gl.constexpr):
        L: gl.constexpr = g._copy_layout(D)
        RB: gl.constexpr = D + D // 32
        rows = gl.program_id(0) * SUB + gl.arange(0, SUB, layout=gl.SliceLayout(1, L))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, L))
        ecol = gl.arange(0, D // 16, layout=gl.SliceLayout(0, L))
        codes = gl.allocate_shared_memory(gl.uint8, [SUB, D], g._raw_layout(),
                                          gl.load(raw_ptr + rows[:, None] * RB + cols[None, :]))
        extra = gl.allocate_shared_memory(
            gl.uint8, [SUB, D // 16], g._raw_layout(),
            gl.load(raw_ptr + rows[:, None] * RB + D + ecol[None, :],
                    mask=(ecol < D // 32)[None, :], other=0))
        g._thread_barrier()
        for r0 in gl.static_range(0, SUB, RS):
            v = gl.convert_layout(g._window_decode(codes.slice(r0, RS, dim=0),
                                                   extra.slice(r0, RS, dim=0), RS, D), L)
            orow = gl.program_id(0) * SUB + r0 + gl.arange(0, RS, layout=gl.SliceLayout(1, L))
            gl.store(out_ptr + orow[:, None] * D + cols[None, :], v)

    return probe


@pytest.mark.parametrize("triton_dir", sm90_compile.TRITONS,
                         ids=lambda v: "this" if v is None else os.path.basename(v))
def test_decode_probe_compiles_for_sm90(triton_dir):
    """The window decode's probe kernel (below, GPU only) lowers for sm_90a under this Triton
    and the GPU image's, so the probe cannot rot between GPU sessions."""
    pytest.importorskip("triton.experimental.gluon")
    r = sm90_compile.compile_probe(r"""
import test_sparse_attn_gluon as t
import dsv41attn.ops.sparse_attn.gluon as g
k = t._decode_probe().warmup(M(torch.uint8), M(torch.bfloat16), D=512, SUB=g.SUB_ROWS,
                             RS=g.ROWS_PER_STORE, num_warps=4, grid=(1,))
print(json.dumps({"f2fp": s._sass(k.asm["cubin"]).count("F2FP")}))
""", triton_dir)
    assert r["f2fp"] > 0, r  # the e4m3 unpacks and bf16 packs of the decode


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU (Gluon does not run under the interpreter)")
def test_window_decode_is_exact_for_every_code_and_exponent():
    """Every e4m3 code (NaN and subnormal codes included) under every ue8m0 exponent byte (0:
    scale 0; 255: inf), decoded by the producer's window decode, gives the reference
    unpacking's bits, NaN where it has NaN."""
    import dsv41attn.ops.sparse_attn.gluon as g
    from dsv41attn.ops.common.packing import unpack_window_rows
    d = 512
    blk = torch.arange(d // 32)
    # row r, 32-code block b: codes 32 (b % 8) .. + 31, exponent 2r + b // 8: 128 rows, all pairs
    codes = ((blk % 8)[:, None] * 32 + torch.arange(32)).flatten().repeat(128, 1)
    e = (2 * torch.arange(128)[:, None] + blk // 8) % 256
    packed = torch.cat([codes, e], 1).to(torch.uint8)
    want = unpack_window_rows(packed)
    out = torch.empty(128, d, dtype=torch.bfloat16, device="cuda")
    _decode_probe()[(128 // g.SUB_ROWS,)](packed.cuda(), out, D=d, SUB=g.SUB_ROWS,
                                          RS=g.ROWS_PER_STORE, num_warps=4)
    got = out.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert 0 < nan.sum() < nan.numel()
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
def test_rejects_bad_inputs():
    from dsv41attn.ops.sparse_attn.gluon import sparse_attn_paged_ws
    q, sink, args = make_step(3, 64, 512, 10, 0, 4)
    with pytest.raises(ValueError, match="stages"):
        sparse_attn_paged_ws(q, sink, 0.1, **args, stages=3)
    with pytest.raises(ValueError, match="split_blocks"):
        sparse_attn_paged_ws(q, sink, 0.1, **args, split_blocks=-1)
    with pytest.raises(ValueError, match="num_splits"):
        sparse_attn_paged_ws(q, sink, 0.1, **args, num_splits=0)
    with pytest.raises(ValueError, match="programs must be a positive int"):
        sparse_attn_paged_ws(q, sink, 0.1, **args, programs=0)
    with pytest.raises(ValueError, match="one device"):
        sparse_attn_paged_ws(q, sink.cpu(), 0.1, **args)
    with pytest.raises(ValueError, match="H must be"):
        sparse_attn_paged_ws(torch.zeros(3, 65, 512, dtype=torch.bfloat16, device="cuda"),
                             torch.zeros(65, device="cuda"), 0.1, **args)


def _shifted(x: torch.Tensor, by: int) -> torch.Tensor:
    """A contiguous copy of x whose storage starts ``by`` bytes past an aligned allocation."""
    buf = torch.empty(x.numel() + by, dtype=torch.uint8, device=x.device)
    y = buf[by:].view(x.shape)
    y.copy_(x)
    return y


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
def test_alignment_of_the_packed_inputs():
    """The rows are copied in 16-byte pieces: a ring or pool not 16-byte aligned is refused by
    name (read in place, never copied), the step's new rows are copied to an aligned buffer
    (the same output)."""
    from dsv41attn.ops.sparse_attn.gluon import sparse_attn_paged_ws
    q, sink, args = make_step(3, 64, 512, 70, 65, 8, seed=3)
    want = sparse_attn_paged_ws(q, sink, 0.1, **args)
    got = sparse_attn_paged_ws(q, sink, 0.1, **dict(args, new_rows=_shifted(args["new_rows"], 4)))
    assert torch.equal(got, want)
    for name in ("window_ring", "compressed_pool"):
        with pytest.raises(ValueError, match=f"{name} must start 16-byte aligned"):
            sparse_attn_paged_ws(q, sink, 0.1, **dict(args, **{name: _shifted(args[name], 4)}))


def test_the_backend_runs_the_triton_kernel_off_hopper():
    """Off a Hopper GPU (here the CPU, under the interpreter) the triton backend's attention
    is the Triton kernel: the same bits, splits and all."""
    from dsv41attn.ops.backends import get_ops
    from dsv41attn.ops.sparse_attn.paged import uses_gluon
    from dsv41attn.ops.sparse_attn.triton import sparse_attn_paged as tri_paged
    q, sink, args = make_step(3, 8, 128, 70, 65, 8, seed=5)
    if q.is_cuda and GPU:
        pytest.skip("a Hopper GPU runs the Gluon kernel (the test below)")
    assert not uses_gluon(q, args["window_ring"], args["compressed_pool"])
    for invariant in (False, True):
        got = get_ops("triton", batch_invariant=invariant).sparse_attn_paged(q, sink, 0.1, **args)
        want = tri_paged(q, sink, 0.1, **args, **({} if invariant else {"split_blocks": 0}))
        assert torch.equal(got, want)


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize("invariant", [False, True])
def test_the_backend_runs_the_gluon_kernel_on_hopper(invariant):
    """On a Hopper GPU the triton backend's attention is the Gluon kernel, in the backend's
    splits (sized to the step, or the fixed cut), bit for bit; a Triton-only launch option, a
    cache not 16-byte aligned or more than 64 heads take the Triton kernel; a window-only
    layer (no compressed pool) runs the Gluon kernel too; the choice never follows the step's
    batch or lists (a pool with no entry selected yet runs the Gluon kernel)."""
    from dsv41attn.ops.backends import get_ops
    from dsv41attn.ops.sparse_attn.gluon import sparse_attn_paged_ws
    from dsv41attn.ops.sparse_attn.paged import uses_gluon
    from dsv41attn.ops.sparse_attn.triton import sparse_attn_paged as tri_paged
    paged = get_ops("triton", batch_invariant=invariant).sparse_attn_paged
    cut = {} if invariant else {"split_blocks": 0}
    for t, ww, k in ((1, 128, 512), (9, 128, 512), (4, 128, 0), (2, 0, 65)):
        q, sink, args = make_step(t, 64, 512, ww, k, 8, seed=t + k)
        if not k:  # a compressed layer's step with no entry selected: its pool all the same
            _, _, with_pool = make_step(t, 64, 512, ww, 1, 8)
            args.update(compressed_pool=with_pool["compressed_pool"],
                        block_table=with_pool["block_table"])
        assert uses_gluon(q, args["window_ring"], args["compressed_pool"])
        got = paged(q, sink, 0.1, **args)
        assert torch.equal(got, sparse_attn_paged_ws(q, sink, 0.1, **args, **cut)), (t, ww, k)
    assert not uses_gluon(q, args["window_ring"], args["compressed_pool"], {"block_h": 16})
    got = paged(q, sink, 0.1, **args, num_warps=4)
    assert torch.equal(got, tri_paged(q, sink, 0.1, **args, num_warps=4, **cut))
    ring = _shifted(args["window_ring"], 4)
    assert not uses_gluon(q, ring, args["compressed_pool"])
    got = paged(q, sink, 0.1, **dict(args, window_ring=ring))
    assert torch.equal(got, tri_paged(q, sink, 0.1, **dict(args, window_ring=ring), **cut))
    q65 = torch.zeros(2, 65, 512, dtype=torch.bfloat16, device="cuda")
    assert not uses_gluon(q65, args["window_ring"], args["compressed_pool"])
    q, sink, args = make_step(5, 64, 512, 128, 0, 8, seed=1)  # a window-only layer: no pool
    assert args["compressed_pool"] is None
    assert uses_gluon(q, args["window_ring"], args["compressed_pool"])
    got = paged(q, sink, 0.1, **args)
    assert torch.equal(got, sparse_attn_paged_ws(q, sink, 0.1, **args, **cut))
    ref = ref_paged(q.cpu(), sink.cpu(), 0.1, **{n: v if v is None else v.cpu()
                                                 for n, v in args.items()})
    tri = tri_paged(q, sink, 0.1, **args, **cut)
    err_tri = (tri.float().cpu() - ref.float()).abs().max().item()
    assert (got.float().cpu() - ref.float()).abs().max().item() <= max(2 * err_tri, 1e-2)
