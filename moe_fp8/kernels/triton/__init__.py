"""Triton kernels of the MoE data path: everything around the two grouped GEMMs.

One module per family, one launch wrapper per kernel (wrappers receive arguments already validated by
``moe_fp8.ops`` and only guard memory safety):

- ``quant``    — ``per_token_group_quant`` and the fused ``silu_mul_per_token_group_quant``
                 (contiguous and masked), scales written straight into the TMA layout.
- ``routing``  — ``select_experts``: softmax top-k and DeepSeek-V3 grouped top-k.
- ``dispatch`` — ``dispatch_contiguous`` (one host sync, for the output size), ``dispatch_masked``
                 (none), ``combine``.
- ``configs``  — block sizes and warp counts: plain Python, testable without a GPU.
- ``common``   — shared ``@triton.jit`` helpers (FP8 encoding, scales, sort keys) and launch helpers.

They are registered in ``moe_fp8.ops`` for both the ``hopper`` and the ``portable`` backends as lazy
``"module:attr"`` strings, so nothing here (nor Triton) is imported on a machine that never selects
them. Every kernel reproduces ``moe_fp8.reference`` bit for bit (FP8 bytes, scales, ids, row maps;
see each module for the one or two places where the reference itself is only defined up to the
summation order of a float32 sum).

Every kernel also runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this package is imported), which is how CI tests them without a GPU.
"""
