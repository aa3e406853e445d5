"""ops/step_facts: the decode-step facts from the Triton kernels equal the torch reference's
(integers: exactly), for random positions, rows, ratios and block tables."""
import pytest
import torch

from dsv41attn.ops.step_facts import reference as R

T = pytest.importorskip("dsv41attn.ops.step_facts.triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("window,slots,ratio", [(8, 12, 1), (8, 12, 2), (128, 144, 2), (5, 5, 4)])
def test_decode_facts_match_reference(window, slots, ratio):
    g = torch.Generator().manual_seed(window + ratio)
    b, pages, page_rows = 7, 9, 4 // ratio if ratio <= 4 else 1
    page_size = page_rows * ratio
    row = torch.randperm(b + 3, generator=g)[:b].to(DEV)
    pos = torch.randint(0, pages * page_size, (b,), generator=g).to(DEV)
    pos[0] = 0
    table = torch.randperm(100, generator=g)[: (b + 3) * pages].view(b + 3, pages).to(DEV)
    first = torch.arange(b, device=DEV)
    n_ring, held = (b + 3) * slots, ratio + 3
    ids, flat = T.decode_window_facts(pos, row, window, slots, n_ring)
    assert torch.equal(ids, R.window_ids(pos, pos, first, row, window, slots, n_ring))
    assert torch.equal(flat, R.ring_slots(pos, pos, row, slots)[1])
    vis, page, slot, gpos, members, recent = T.decode_group_facts(
        pos, row, table, ratio, page_rows, held, (b + 3) * held, True)
    closing, page_r, slot_r, gpos_r, members_r = R.group_facts(
        pos, pos, first, row, table, ratio, page_rows, held, (b + 3) * held)
    assert torch.equal(vis, (pos + 1) // ratio)
    assert torch.equal(page, page_r) and torch.equal(slot, slot_r) and torch.equal(gpos, gpos_r)
    if ratio > 1:
        assert torch.equal(members, members_r)
        assert torch.equal(recent, R.ring_slots(pos, pos, row, held)[1])
    else:
        assert members is None and recent is None
    only_vis = T.decode_group_facts(pos, row, table, ratio, page_rows, held, 0, False)
    assert torch.equal(only_vis[0], vis) and only_vis[1:] == (None,) * 5
