"""Packed cache rows (SPEC §0.4): sizes, and unpacking reproduces the fake-quantised bf16 values
bit for bit (signed zeros, saturation, tiny and subnormal scales included)."""
import pytest
import torch

from dsv41attn import preset
from dsv41attn.ops.common.packing import compressed_row_bytes, index_key_bytes, window_row_bytes
from dsv41attn.ops.common.packing import (pack_fp4, quantize_compressed_rows, quantize_index_keys,
                                          quantize_window_rows, unpack_compressed_rows,
                                          unpack_fp4, unpack_index_keys, unpack_window_rows)
from dsv41attn.ops.common.quant import (fp8_fake_quant, index_fp4_fake_quant,
                                        latent_fp4_fake_quant)

CODECS = {
    "window": (quantize_window_rows, unpack_window_rows, fp8_fake_quant, 512, 528),
    "compressed": (quantize_compressed_rows, unpack_compressed_rows, latent_fp4_fake_quant, 512, 288),
    "index_key": (quantize_index_keys, unpack_index_keys, index_fp4_fake_quant, 128, 68),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _hard_rows(d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([0.0, 1e-30, 1e-8, 2.0 ** -9, 9 * 2.0 ** -9, 1e-3, 1.0, 448.0, 3e4, 1e30])
    x = torch.randn(len(scales), 5, d, generator=g) * scales[:, None, None]
    x[1, 0, :16] = -0.0  # signed zeros must survive
    x[2, 1, ::7] = 0.0
    x[6, 2, 3] = 6.0 * 1.25  # an e2m1 tie after scaling
    return x.to(torch.bfloat16)


def test_row_bytes_match_spec():
    cfg = preset("v41-flash")
    assert (window_row_bytes(cfg.head_dim), compressed_row_bytes(cfg.head_dim),
            index_key_bytes(cfg.index_head_dim)) == (528, 288, 68)


@pytest.mark.parametrize("name", list(CODECS))
def test_unpack_is_bit_exact(name):
    quantize, unpack, fake_quant, d, nbytes = CODECS[name]
    x = _hard_rows(d)
    values, packed = quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], nbytes)
    assert torch.equal(_bits(values), _bits(fake_quant(x)))
    assert torch.equal(_bits(unpack(packed)), _bits(values))
    assert torch.equal(_bits(unpack(packed[3:, 1:4])), _bits(values[3:, 1:4]))  # slices too


def test_fp4_nibbles_round_trip_every_code():
    values = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    packed = pack_fp4(values)
    assert packed.shape == (8,)
    assert torch.equal(unpack_fp4(packed), values)
    assert torch.equal(torch.signbit(unpack_fp4(packed)), torch.signbit(values))
    # element 2i in the low nibble
    assert int(pack_fp4(torch.tensor([6.0, 0.5]))[0]) == (1 << 4) | 7
