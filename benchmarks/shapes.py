"""Shape tables: DeepSeek-V3 layers, as in shared/ANCHORS.md (the numbers to beat)."""

from __future__ import annotations

# (N, K) of DeepSeek-V3's block-FP8 linears in the goal table.
GEMM_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
GEMM_M = [64, 128, 4096]
GEMM_SHAPES = [(m, n, k) for m in GEMM_M for n, k in GEMM_NK]

# DeepGEMM (July 2025 version) on the same H100, TFLOPS, from ANCHORS.md.
DEEPGEMM_GEMM_TFLOPS = {
    (64, 2112, 7168): 156, (64, 24576, 1536): 232, (64, 32768, 512): 193, (64, 7168, 16384): 289,
    (64, 4096, 7168): 207, (64, 7168, 2048): 193,
    (128, 2112, 7168): 284, (128, 24576, 1536): 438, (128, 32768, 512): 347, (128, 7168, 16384): 528,
    (128, 4096, 7168): 368, (128, 7168, 2048): 345,
    (4096, 2112, 7168): 1144, (4096, 24576, 1536): 1283, (4096, 32768, 512): 943,
    (4096, 7168, 16384): 1497, (4096, 4096, 7168): 1442, (4096, 7168, 2048): 1250,
}

# M-grouped rows of ANCHORS.md: (groups, expected M per group, N, K) -> DeepGEMM TFLOPS.
CONTIGUOUS_SHAPES = {
    (4, 8192, 4096, 7168): 1372, (4, 8192, 7168, 2048): 1277, (8, 4096, 4096, 7168): 1344,
    (8, 4096, 7168, 2048): 1262, (32, 256, 4096, 7168): 865, (32, 256, 7168, 2048): 842,
}
# masked: (groups, max_m, expected M, N, K) -> DeepGEMM TFLOPS (or None where only GB/s is known).
MASKED_SHAPES = {
    (1, 4096, 1024, 4096, 7168): 1010, (1, 4096, 1024, 7168, 2048): 833, (2, 4096, 512, 4096, 7168): 697,
    (2, 4096, 512, 7168, 2048): 748, (4, 4096, 256, 4096, 7168): 562, (4, 4096, 256, 7168, 2048): 521,
}
# Decode-sized masked shapes: DeepGEMM's GB/s (memory-bound).
MASKED_DECODE_GBPS = {
    (32, 256, 8, 4096, 7168): 2800, (32, 256, 32, 4096, 7168): 2840, (32, 256, 64, 4096, 7168): 2510,
    (32, 256, 8, 7168, 2048): 2650, (32, 256, 32, 7168, 2048): 2730, (32, 256, 64, 7168, 2048): 2530,
}
