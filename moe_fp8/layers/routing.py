"""Expert routing: ``select_experts`` (softmax top-k and DeepSeek-V3 grouped top-k).

The validated public wrapper and its ``torch.ops.moe_fp8.select_experts`` registration live in
``moe_fp8.ops``; this module is its home in the ``layers`` namespace.
"""

from __future__ import annotations

from moe_fp8.ops import select_experts

__all__ = ["select_experts"]
