"""Dispatch tokens to experts and combine their outputs (DESIGN §2, §5).

- ``dispatch_contiguous`` → contiguous grouped layout (prefill; data-dependent size, a plain function);
- ``dispatch_masked`` → masked grouped layout (decode; fixed size, CUDA-graph safe custom op);
- ``quant_dispatch_contiguous`` → ``per_token_group`` then ``dispatch_contiguous`` as one op (the GPU
  quantizes and copies the rows while the host waits for the layout's size);
- ``quant_dispatch_masked`` → ``per_token_group`` then ``dispatch_masked`` as one op (one launch at decode);
- ``combine`` → weighted sum of each token's expert outputs (custom op).

The validated public wrappers and registrations live in ``moe_fp8.ops`` (one place for every op).
"""

from __future__ import annotations

from moe_fp8.ops import (
    combine,
    dispatch_contiguous,
    dispatch_masked,
    quant_dispatch_contiguous,
    quant_dispatch_masked,
)

__all__ = ["combine", "dispatch_contiguous", "dispatch_masked", "quant_dispatch_contiguous", "quant_dispatch_masked"]
