"""Inverse RoPE and the block-diagonal wo_a projection (docs/numerics.md §5, step 6), the
layer's lines verbatim.

The attention output's RoPE tail (the last R dims of each head, interleaved pairs) is rotated
back by the query position (complex64 product with the conjugate rotation, rounded to bf16),
then each group of H*D/G consecutive o dims is projected by its own [Rk, H*D/G] block of wo_a:
a bf16 einsum (fp32 accumulation), bf16 out.
"""
from __future__ import annotations

import torch

from ...checkpoint import Fp8Weight
from ..common.buffers import out_buffer
from ..common.cpu_kernels import torch_bf16_matmul
from ..common.rope import apply_rope
from ..linear.reference import fp8_linear


def check_inputs(o: torch.Tensor, rot: torch.Tensor | None, wo_a: torch.Tensor | Fp8Weight,
                 groups: int) -> tuple[int, int]:
    """Validate ``inverse_rope_wo_a``'s arguments; returns (K per group, Rk). Raises ValueError."""
    if not isinstance(o, torch.Tensor) or o.dim() != 3 or o.dtype != torch.bfloat16:
        raise ValueError(f"o must be a bf16 [N, H, D] tensor, got "
                         f"{getattr(o, 'dtype', type(o))} {tuple(getattr(o, 'shape', ()))}")
    n, h, d = o.shape
    if rot is not None:  # None: o's tail already turned back (sparse_attn_paged's out_rot)
        if not isinstance(rot, torch.Tensor) or rot.dim() != 2 or rot.dtype != torch.complex64:
            raise ValueError(f"rot must be None or a complex64 [N, R/2] tensor, got "
                             f"{getattr(rot, 'dtype', type(rot))} "
                             f"{tuple(getattr(rot, 'shape', ()))}")
        if rot.shape[0] != n or not 1 <= rot.shape[1] <= d // 2:
            raise ValueError(f"rot {tuple(rot.shape)} does not fit o {tuple(o.shape)}: want "
                             f"[{n}, R/2] with 1 <= R/2 <= {d // 2}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 \
            or (h * d) % groups:
        raise ValueError(f"groups must be a positive int dividing H*D = {h * d}, got {groups!r}")
    k = h * d // groups
    if isinstance(wo_a, Fp8Weight):
        weight = wo_a.weight  # its scale's shape is checked by Fp8Weight itself
    elif isinstance(wo_a, torch.Tensor) and wo_a.dtype == torch.bfloat16:
        weight = wo_a
    else:
        raise ValueError(f"wo_a must be a bf16 tensor or an Fp8Weight, got "
                         f"{getattr(wo_a, 'dtype', type(wo_a))}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.shape[0] % groups:
        raise ValueError(f"wo_a {tuple(weight.shape)} must be [groups * Rk, H*D/groups] = "
                         f"[{groups} * Rk, {k}]")
    devices = {o.device, weight.device} | ({rot.device} if rot is not None else set())
    if isinstance(wo_a, Fp8Weight):
        devices.add(wo_a.scale.device)
    if len(devices) != 1:
        raise ValueError(f"o, rot and wo_a must be on one device, got {sorted(map(str, devices))}")
    return k, weight.shape[0] // groups


def prepare_wo_a(wo_a: torch.Tensor | Fp8Weight, previous: object = None) -> dict:
    """Extra arguments of ``inverse_rope_wo_a`` prepared once per layer: none (it reads wo_a as
    it is; the triton backend keeps wo_a's e4m3 codes for decode-sized calls, ``previous``
    the ones it had)."""
    return {}


def inverse_rope_wo_a(o: torch.Tensor, rot: torch.Tensor | None, wo_a: torch.Tensor | Fp8Weight,
                      groups: int, *, out: torch.Tensor | None = None,
                      in_place: bool = False) -> torch.Tensor:
    """u[n, g*Rk + r] = sum_k rope^-1(o)[n, g*K + k] * wo_a[g*Rk + r, k], K = H*D/groups.

    o: [N, H, D] bf16 attention output of N query rows (flattened over head then dim, its
    group g is dims g*K..(g+1)*K); rot: [N, R/2] complex64 rotation of each row's position (the
    last R dims of each head are rotated by its conjugate), or None: o is turned back already
    (sparse_attn_paged's out_rot), only wo_a remains; wo_a: [groups*Rk, K] bf16, or the
    checkpoint's Fp8Weight (e4m3 + e8m0 32x32 block scales), dequantised exactly to bf16 first;
    out: optional contiguous bf16 [N, groups*Rk] to write into; in_place: the caller no longer
    needs o, which the Triton op then rotates in place (here: unused). Returns [N, groups*Rk]
    bf16.
    """
    k, rk = check_inputs(o, rot, wo_a, groups)
    if out is not None:
        out_buffer(out, (o.shape[0], groups * rk), torch.bfloat16, o.device)
    weight = wo_a.dequantize() if isinstance(wo_a, Fp8Weight) else wo_a
    n = o.shape[0]
    if rot is not None:
        o = apply_rope(o, rot.unsqueeze(1), inverse=True)  # [N, H, D], rot over the heads
    with torch_bf16_matmul(o.device):  # the fixtures' kernel on any CPU (cpu_kernels)
        u = torch.einsum("ngd,grd->ngr", o.reshape(n, groups, k), weight.view(groups, rk, k))
    u = u.flatten(1)  # [N, groups*Rk] bf16
    return u if out is None else out.copy_(u)


def output_projection(o: torch.Tensor, rot: torch.Tensor | None, wo_a: torch.Tensor | Fp8Weight,
                      groups: int, wo_b: torch.Tensor, wo_b_scale: torch.Tensor,
                      **wo_a_kw) -> torch.Tensor:
    """Step 6 whole for a layer without tensor parallelism: the inverse RoPE, the grouped wo_a
    (``inverse_rope_wo_a``, with its keyword arguments) and the fp8 wo_b [dim, groups * Rk]
    (block scales wo_b_scale): [N, dim] bf16."""
    return fp8_linear(inverse_rope_wo_a(o, rot, wo_a, groups, **wo_a_kw), wo_b, wo_b_scale)
