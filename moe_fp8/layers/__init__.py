"""MoE building blocks: routing, dispatch / combine (Fp8Linear and Fp8FusedMoE to come)."""

from __future__ import annotations

from moe_fp8.layers.dispatch import combine, dispatch_contiguous, dispatch_masked
from moe_fp8.layers.routing import select_experts

__all__ = ["combine", "dispatch_contiguous", "dispatch_masked", "select_experts"]
