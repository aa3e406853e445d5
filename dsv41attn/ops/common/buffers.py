"""The ops' optional ``out`` arguments: one check, one error message."""
from __future__ import annotations

import torch


def out_buffer(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device, name: str = "out") -> torch.Tensor:
    """``out`` when it is a contiguous ``dtype`` tensor of ``shape`` on ``device`` (a
    ValueError naming what it is otherwise), or a new such tensor when None."""
    shape = tuple(int(s) for s in shape)
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not (isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.dtype == dtype
            and out.device == torch.device(device) and out.is_contiguous()):
        got = (f"{out.dtype} {list(out.shape)} on {out.device}"
               + ("" if out.is_contiguous() else ", not contiguous")
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"{name} must be a contiguous {dtype} {list(shape)} tensor on "
                         f"{device}, got {got}")
    return out
