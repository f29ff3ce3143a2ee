"""Expert routing: ``router_gemm`` (the router's float32 logits) and ``select_experts`` (softmax top-k and
DeepSeek-V3 grouped top-k).

The validated public wrappers and their ``torch.ops.moe_fp8`` registrations live in ``moe_fp8.ops``; this
module is their home in the ``layers`` namespace.
"""

from __future__ import annotations

from moe_fp8.ops import router_gemm, select_experts

__all__ = ["router_gemm", "select_experts"]
