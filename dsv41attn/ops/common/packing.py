"""Byte layouts of the cached rows (docs/numerics.md §3). Each packs the (codes, scales) a
quantiser produced, so unpacking gives back the fake-quantised bf16 values bit for bit.

| row | layout | bytes (V4.1-Flash) |
|---|---|---|
| window K=V | D e4m3 codes, then D/32 ue8m0 exponents | 512 + 16 = 528 |
| compressed row | D/2 bytes of e2m1 pairs (element 2i in the low nibble), then D/16 e4m3 scales | 256 + 32 = 288 |
| index key | d/2 bytes of e2m1 pairs, then d/32 ue8m0 exponents | 64 + 4 = 68 |

An e2m1 nibble is sign << 3 | index into (0, 0.5, 1, 1.5, 2, 3, 4, 6); a ue8m0 byte is the
biased exponent of a power-of-two scale.
"""
from __future__ import annotations

import torch

from .quant import FP8_BLOCK, INDEX_FP4_BLOCK, LATENT_FP4_BLOCK, act_quant, fp4_quant


def window_row_bytes(head_dim: int) -> int:
    """Bytes of a packed window row: D e4m3 codes + D/32 ue8m0 exponents (528 at D = 512)."""
    return head_dim + head_dim // FP8_BLOCK


def compressed_row_bytes(head_dim: int) -> int:
    """Bytes of a packed compressed row: D/2 e2m1 pairs + D/16 e4m3 scales (288 at D = 512)."""
    return head_dim // 2 + head_dim // LATENT_FP4_BLOCK


def index_key_bytes(index_head_dim: int) -> int:
    """Bytes of a packed index key: d/2 e2m1 pairs + d/32 ue8m0 exponents (68 at d = 128)."""
    return index_head_dim // 2 + index_head_dim // INDEX_FP4_BLOCK


def _e8m0_bytes(s: torch.Tensor) -> torch.Tensor:
    return ((s.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _e8m0_values(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int32) << 23).view(torch.float32)


def _e2m1_nibbles(v: torch.Tensor) -> torch.Tensor:
    """Exact e2m1 values -> nibbles. Arithmetic rather than a table lookup: no host-to-device
    copy, so packing can run inside a CUDA-graph capture."""
    a = v.abs()
    idx = torch.where(a < 2, 2 * a, torch.where(a < 4, a + 2, a / 2 + 4)).to(torch.uint8)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


def _e2m1_values(n: torch.Tensor) -> torch.Tensor:
    """Nibbles -> fp32 e2m1 values (the inverse of _e2m1_nibbles)."""
    i = (n & 7).to(torch.float32)
    mag = torch.where(i < 4, i / 2, torch.where(i < 6, i - 2, (i - 4) * 2))
    return torch.where((n & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] fp32 e2m1 values -> [..., K/2] uint8, element 2i in the low nibble."""
    nib = _e2m1_nibbles(codes).unflatten(-1, (-1, 2))
    return nib[..., 0] | (nib[..., 1] << 4)


_E2M1_PAIRS: dict[torch.device, torch.Tensor] = {}


def _e2m1_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two e2m1 values of every byte, low nibble first (``_e2m1_values`` of
    each nibble, so the same values, signed zeros included), built once per device on the
    device itself (no host-to-device copy)."""
    table = _E2M1_PAIRS.get(device)
    if table is None:
        b = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
        table = _E2M1_PAIRS[device] = torch.stack([_e2m1_values(b & 0xF), _e2m1_values(b >> 4)], -1)
    return table


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] fp32 e2m1 values (one table gather per byte)."""
    return _e2m1_pairs(packed.device)[packed.long()].flatten(-2)


def pack_window_rows(kv: torch.Tensor) -> torch.Tensor:
    """Window K=V: bf16 [..., D] -> fp8 quantised, packed uint8 [..., D + D/32]."""
    codes, s = act_quant(kv, FP8_BLOCK)
    return torch.cat([codes.to(torch.float8_e4m3fn).view(torch.uint8), _e8m0_bytes(s)], -1)


def quantize_window_rows(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 fake-quantised bf16 [..., D], packed uint8 [..., D + D/32])."""
    packed = pack_window_rows(kv)
    return unpack_window_rows(packed), packed


def unpack_window_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D + D/32] -> bf16 [..., D]."""
    d = packed.shape[-1] * FP8_BLOCK // (FP8_BLOCK + 1)
    codes = packed[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    s = _e8m0_values(packed[..., d:])
    return (codes.unflatten(-1, (-1, FP8_BLOCK)) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def pack_compressed_rows(latent: torch.Tensor) -> torch.Tensor:
    """Latents: bf16 [..., D] -> fp4 e4m3/16 quantised, packed uint8 [..., D/2 + D/16]."""
    codes, s = fp4_quant(latent, LATENT_FP4_BLOCK, "e4m3")
    return torch.cat([pack_fp4(codes), s.to(torch.float8_e4m3fn).view(torch.uint8)], -1)


def quantize_compressed_rows(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp4 e4m3/16 fake-quantised bf16 [..., D], packed uint8 [..., D/2 + D/16])."""
    packed = pack_compressed_rows(latent)
    return unpack_compressed_rows(packed), packed


def unpack_compressed_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2 + D/16] -> bf16 [..., D]."""
    d = packed.shape[-1] * 16 // 9
    codes = unpack_fp4(packed[..., : d // 2])
    s = packed[..., d // 2:].contiguous().view(torch.float8_e4m3fn).float()
    return (codes.unflatten(-1, (-1, LATENT_FP4_BLOCK)) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def pack_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """Index keys: bf16 [..., d] -> fp4 ue8m0/32 quantised, packed uint8 [..., d/2 + d/32]."""
    codes, s = fp4_quant(keys, INDEX_FP4_BLOCK, "ue8m0")
    return torch.cat([pack_fp4(codes), _e8m0_bytes(s)], -1)


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp4 ue8m0/32 fake-quantised bf16 [..., d], packed uint8 [..., d/2 + d/32])."""
    packed = pack_index_keys(keys)
    return unpack_index_keys(packed), packed


def unpack_index_keys(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., d/2 + d/32] -> bf16 [..., d]."""
    d = packed.shape[-1] * 32 // 17
    codes = unpack_fp4(packed[..., : d // 2])
    s = _e8m0_values(packed[..., d // 2:])
    return (codes.unflatten(-1, (-1, INDEX_FP4_BLOCK)) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def paged_rows(pool: torch.Tensor, block_table: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Rows ``g`` of a paged pool: pool [P, page_rows, bytes], block_table [B, pages] page ids
    per sequence, g [n] (or [B, n]) row numbers -> [B, n, bytes]."""
    page_rows = pool.shape[1]
    pages = torch.gather(block_table, 1, (g // page_rows).expand(block_table.shape[0], -1))
    return pool[pages.clamp_min(0), g % page_rows]


def paged_index_keys(pool: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n, d] bf16: index keys 0..n-1 of each sequence of ``block_table`` [B, pages] from
    the paged pool [P, page_rows, d/2 + d/32]; rows on unallocated pages read as zeros (the
    reference's zero-initialised key cache)."""
    g = torch.arange(n, device=pool.device)
    keys = unpack_index_keys(paged_rows(pool, block_table, g))
    pages = torch.gather(block_table, 1, (g // pool.shape[1]).expand(block_table.shape[0], -1))
    return keys.masked_fill((pages < 0).unsqueeze(-1), 0)
