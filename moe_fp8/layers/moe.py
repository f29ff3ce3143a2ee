"""``Fp8FusedMoE``: a block-FP8 mixture-of-experts layer in the DeepSeek-V3 layout (DESIGN §5).

Forward of ``hidden [T, H]`` with ``router_logits [T, E]``::

    topk_weights, topk_ids = layers.select_experts(router_logits, ...)
    contiguous (prefill)                       | masked (decode, CUDA-graph safe)
      x_fp8, x_scale, [M_bound, H], m_indices, |   x_fp8, x_scale, [E_local, T, H], masked_m, row_map =
        row_map, m_total =                     |     quant_dispatch_masked(hidden)  # one launch at decode
        quant_dispatch_contiguous(h, sync=False)
      fp8_grouped_gemm_silu_mul_quant          |   fp8_grouped_gemm_silu_mul_quant
        (w13, m_indices, m_total)              |     (w13, masked_m)
      fp8_grouped_gemm_contiguous (w2, m_total)  |   fp8_grouped_gemm_masked (w2)
    combine(y, row_map, topk_weights, shared_output)             # + shared experts (Fp8MLP on x_fp8)

One quantization of ``hidden`` per forward, shared by the routed and the shared experts. Neither path
syncs with the host: the contiguous layout is sized by its upper bound and its real row count
``m_total`` stays on the device (``contiguous_sync=True`` sizes it exactly, with one sync).
GEMM1 runs with SiLU·mul + quant in its epilogue (``fp8_grouped_gemm_silu_mul_quant``) where that op
has its Hopper kernel (``FUSE_GEMM1_ACT``); elsewhere, and with the flag off, GEMM1 writes the bf16
``h`` and ``silu_mul_per_token_group`` quantizes it.

Every step is a public ``moe_fp8`` op, so the layer runs on the Hopper kernels where they exist and on
the PyTorch reference elsewhere (CPU included).

Decode workspace. The masked path writes its ``[E_local, T, ·]`` intermediates into a
``MaskedWorkspace`` the layer owns: allocated once per (device, GEMM output dtype, max_m =
``masked_max_tokens``, fused GEMM1 or not) on first use, then reused by every masked forward of at
most ``max_m`` tokens (eager calls and every captured CUDA graph alike), so a graph captures no
allocation of those buffers and all graphs share one copy. Warm up once before capturing so the
workspace comes from the ordinary allocator pool rather than the first graph's. Larger masked batches
(an explicit ``path="masked"``, or capture with ``contiguous_sync``) allocate per call, as the ops do.

UE8M0. ``ue8m0=True`` (DeepSeek-V3.1 checkpoints, ``quantization_config.scale_fmt = "ue8m0"``) quantizes
the activations with power-of-two scales (both quantizations of the forward, shared experts included);
the loaders check that the weights' scales are powers of two too.

Parallelism. Expert parallel: ``expert_map`` (global id → local id, -1 = not on this rank) selects the
experts a rank holds; token copies routed elsewhere contribute nothing here. Tensor parallel: the
weights hold a shard of ``I`` (``shard_moe_weights``). Either way the output of one rank is a partial
sum and the caller all-reduces over ranks. Shared experts are added on every rank that has them, so
shard them too (``shard_fp8_linear``) or give them to one rank only.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from moe_fp8 import backends
from moe_fp8.kernels import few_rows
from moe_fp8.layers.dispatch import (
    combine,
    dispatch_contiguous,
    dispatch_masked,
    quant_dispatch_contiguous,
    quant_dispatch_masked,
)
from moe_fp8.layers.linear import FixedDtypeModule, Fp8MLP, _frozen, _is_int
from moe_fp8.layers.routing import select_experts
from moe_fp8.ops import fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked, fp8_grouped_gemm_silu_mul_quant
from moe_fp8.quant import per_token_group, silu_mul_per_token_group
from moe_fp8.utils import GROUP_K, ceil_div, get_tma_aligned_m
from moe_fp8.validation import K_ALIGN, check_int, check_routing_options

__all__ = [
    "MASKED_MAX_ROWS",
    "PATHS",
    "STAGES",
    "Fp8FusedMoE",
    "MaskedBuffers",
    "MaskedWorkspace",
    "StageTimer",
    "choose_dispatch_path",
    "default_masked_max_tokens",
    "experts_contiguous",
    "experts_masked",
    "grouped_experts_contiguous",
    "grouped_experts_masked",
    "masked_expected_m",
]

Tensor = torch.Tensor
_FP8 = torch.float8_e4m3fn

# Crossover between the two dispatch layouts, as a bound on the masked buffer's rows (E_local x T):
# batches of at most max(64, MASKED_MAX_ROWS // E_local) tokens take the masked (decode) path, larger
# ones the contiguous (prefill) path.
# Measured on an H100 (`moe-fp8 bench moe`, DeepSeek-V3 EP rank: 32 of 256 experts, H 7168, I 2048,
# docs/benchmarks/h100-moe.md): the masked path was faster at every batch tried up to 2048 tokens
# (512: 636 vs 918 us; 2048: 700 vs 986 us), because contiguous dispatch syncs with the host and its
# scatter is slower. But the masked buffers grow as E_local x T rows (FP8 activations plus a bf16 GEMM
# output of 2I columns per row), so the switch bounds them: 16384 rows is 512 tokens at 32 local experts
# (the measured case), 64 tokens with all 256 experts on one GPU.
MASKED_MAX_ROWS = 16384


def default_masked_max_tokens(num_local_experts: int) -> int:
    """Largest batch ``path="auto"`` sends down the masked path when ``masked_max_tokens`` is not given."""
    return max(64, MASKED_MAX_ROWS // max(num_local_experts, 1))

PATHS = ("auto", "contiguous", "masked")
# The paths whose forward runs the shared experts on a side stream (``Fp8FusedMoE.shared_overlap``). Not the
# contiguous one: there the persistent wgmma kernels fill every SM and the two streams' GEMMs ran one after the
# other (DeepSeek-V3 EP 8 at 2048 / 8192 tokens 666.6 / 1813.6 µs against 671.7 / 1787.0 in line, H200;
# docs/kernels/datapath.md, session 60).
SHARED_OVERLAP_PATHS = ("masked",)
# Stages of one forward, in order, as ``Fp8FusedMoE.stage_hook`` sees them ("shared" only with shared experts).
# The quantization runs inside the dispatch op (``quant_dispatch_contiguous`` / ``quant_dispatch_masked``):
# "quant" is marked with no work of its own (~0) and "dispatch" holds both, so the stages still add up.
STAGES = ("routing", "quant", "dispatch", "shared", "gemm1", "act_quant", "gemm2", "combine")


class MaskedBuffers(NamedTuple):
    """The masked path's intermediates for one batch of ``m`` tokens (views into a ``MaskedWorkspace``)."""

    a_fp8: Tensor  # dispatch output, float8_e4m3fn [E, m, H]
    a_scale: Tensor  # its scales, float32 [E, m, ceil(H/128)], 3-D TMA layout
    h: Tensor | None  # GEMM1 output, [E, m, 2I] (None in a workspace for the fused GEMM1, which writes no h)
    y_fp8: Tensor  # SiLU·mul + quant output, float8_e4m3fn [E, m, I]
    y_scale: Tensor  # its scales, float32 [E, m, I/128], 3-D TMA layout
    y: Tensor  # GEMM2 output, [E, m, H]


class MaskedWorkspace:
    """Persistent buffers of ``Fp8FusedMoE``'s masked path for batches of up to ``max_m`` tokens.

    Each step of the path reads one buffer and writes another, and no intermediate is read two steps
    later, so two byte regions used in turn hold them all (a ping-pong). With GEMM1 and SiLU·mul + quant
    as two kernels (``fused_gemm1=False``):

    - region P: dispatch output ``a_fp8 [E, m, H]`` (dead once GEMM1 has read it), then the SiLU·mul
      output ``y_fp8 [E, m, I]``;
    - region Q: GEMM1 output ``h [E, m, 2I]`` (dead once SiLU·mul has read it), then the GEMM2 output
      ``y [E, m, H]``;
    - scales: ``a_scale`` then ``y_scale``, in the 3-D TMA layout.

    The fused GEMM1 (``fused_gemm1=True``) reads ``a_*`` while it writes ``y_fp8`` / ``y_scale``, so those
    get their own bytes: P holds ``a_fp8`` then ``y``, Q ``y_fp8``, and the scales two regions; no ``h``.

    For a DeepSeek-V3 EP rank (E 32, H 7168, I 2048, max_m 512) that is 340 MiB (fused: 260 MiB) instead
    of the 501 MiB of four separate buffers. ``views(m)`` gives the tensors of an ``m``-token batch
    (``m <= max_m``): contiguous ``[E, m, ·]`` views from the start of each region (cached per ``m``), so
    the GEMMs see the same shapes and pointers every time ``m`` repeats.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, max_m: int,
                 device: torch.device | str, out_dtype: torch.dtype = torch.bfloat16, *,
                 fused_gemm1: bool = False) -> None:
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.max_m, self.device, self.out_dtype = max_m, torch.device(device), out_dtype
        self.fused_gemm1 = fused_gemm1
        e, h, i = num_experts, hidden_size, intermediate_size
        out_bytes = torch.empty((), dtype=out_dtype).element_size()
        p_row, q_row = (h * out_bytes, i) if fused_gemm1 else (max(h, i), max(2 * i, h) * out_bytes)
        self._p = torch.empty(e * max_m * p_row, dtype=torch.uint8, device=self.device)
        self._q = torch.empty(e * max_m * q_row, dtype=torch.uint8, device=self.device)
        m_pad = get_tma_aligned_m(max_m)
        kg_h, kg_i = ceil_div(h, GROUP_K), ceil_div(i, GROUP_K)
        if fused_gemm1:
            self._s = torch.empty(e * kg_h * m_pad, dtype=torch.float32, device=self.device)
            self._s_y = torch.empty(e * kg_i * m_pad, dtype=torch.float32, device=self.device)
        else:
            self._s = self._s_y = torch.empty(e * max(kg_h, kg_i) * m_pad, dtype=torch.float32, device=self.device)
        self._views: dict[int, MaskedBuffers] = {}

    @property
    def nbytes(self) -> int:
        regions = {t.data_ptr(): t for t in (self._p, self._q, self._s, self._s_y)}.values()
        return sum(t.numel() * t.element_size() for t in regions)

    def _rows(self, region: Tensor, dtype: torch.dtype, m: int, cols: int) -> Tensor:
        n = self.num_experts * m * cols
        return region.view(dtype)[:n].view(self.num_experts, m, cols)

    def _scales(self, region: Tensor, m: int, cols: int) -> Tensor:
        kg, m_pad = ceil_div(cols, GROUP_K), get_tma_aligned_m(m)
        grid = region[:self.num_experts * kg * m_pad].view(self.num_experts, kg, m_pad)
        return grid[:, :, :m].transpose(1, 2)  # the layout of empty_scale_tma(m, kg, groups=E)

    def views(self, m: int) -> MaskedBuffers:
        """The intermediates of an ``m``-token batch, ``0 <= m <= max_m``."""
        bufs = self._views.get(m)
        if bufs is None:
            if not 0 <= m <= self.max_m:
                raise ValueError(f"MaskedWorkspace holds batches of up to {self.max_m} tokens, got {m}")
            h, i, fp8 = self.hidden_size, self.intermediate_size, torch.float8_e4m3fn
            a_fp8, a_scale = self._rows(self._p, fp8, m, h), self._scales(self._s, m, h)
            y_scale = self._scales(self._s_y, m, i)
            if self.fused_gemm1:
                bufs = MaskedBuffers(a_fp8=a_fp8, a_scale=a_scale, h=None, y_fp8=self._rows(self._q, fp8, m, i),
                                     y_scale=y_scale, y=self._rows(self._p, self.out_dtype, m, h))
            else:
                bufs = MaskedBuffers(a_fp8=a_fp8, a_scale=a_scale, h=self._rows(self._q, self.out_dtype, m, 2 * i),
                                     y_fp8=self._rows(self._p, fp8, m, i), y_scale=y_scale,
                                     y=self._rows(self._q, self.out_dtype, m, h))
            self._views[m] = bufs
        return bufs


class StageTimer:
    """Per-stage time of ``Fp8FusedMoE`` forwards: set it as ``layer.stage_hook``.

    Each forward calls it with ``"start"`` and then with each name of ``STAGES`` it runs, right after that
    stage's work is enqueued; it records a CUDA event on the current stream (a ``perf_counter`` reading
    on CPU). ``stages_us()`` (synchronizes) gives, per stage, the time from the previous mark to its own,
    so the stages of one forward add up to the whole forward as the GPU ran it: host gaps (a sync, launch
    overhead the GPU waits on) land in the stage that caused them. Several forwards are kept, one list each.
    """

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.forwards: list[list[tuple[str, object]]] = []

    def __call__(self, stage: str) -> None:
        if stage == "start":
            self.forwards.append([])
        elif not self.forwards:
            raise RuntimeError(f"StageTimer: stage {stage!r} before 'start'")
        if self.cuda:
            mark: object = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        self.forwards[-1].append((stage, mark))

    def stages_us(self) -> list[dict[str, float]]:
        """Microseconds of each stage, one dict per recorded forward (in stage order)."""
        if self.cuda:
            torch.cuda.synchronize()
        result = []
        for marks in self.forwards:
            times = {}
            for (_, prev), (name, cur) in itertools.pairwise(marks):
                times[name] = (prev.elapsed_time(cur) * 1e3 if isinstance(prev, torch.cuda.Event)
                               else (cur - prev) * 1e6)
            result.append(times)
        return result


def _stream_capturing(t: Tensor) -> bool:
    # torch.cuda.is_current_stream_capturing raises on CPU-only builds: ask only for CUDA tensors. Dynamo cannot
    # trace it (a graph break) and a compiled forward takes the masked path anyway: not asked under torch.compile.
    return t.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing()


def _parse_expert_map(expert_map: Tensor | Sequence[int] | None, num_experts: int) -> list[int] | None:
    """Validate a global → local map on the host; returns it as a list (None = all experts local)."""
    if expert_map is None:
        return None
    values = expert_map.tolist() if isinstance(expert_map, Tensor) else list(expert_map)
    if isinstance(expert_map, Tensor) and (expert_map.dim() != 1 or expert_map.is_floating_point()):
        raise ValueError(f"expert_map must be a 1-D integer tensor [num_experts], got {expert_map.dtype} "
                         f"{tuple(expert_map.shape)}")
    if len(values) != num_experts or not all(_is_int(v) for v in values):
        raise ValueError(f"expert_map must hold {num_experts} ints (global → local id, -1 = absent), got "
                         f"{len(values)} values")
    local = sorted(v for v in values if v >= 0)
    if local != list(range(len(local))) or any(v < -1 for v in values):
        raise ValueError("expert_map must map the experts of this rank onto local ids 0..E_local-1, each once, "
                         f"and every other expert to -1; got {values}")
    if not local:
        raise ValueError("expert_map gives this rank no experts (all -1)")
    return values


def choose_dispatch_path(num_tokens: int, masked_max_tokens: int, hidden: Tensor | None = None,
                         path: str = "auto", *, contiguous_sync: bool = False) -> str:
    """The dispatch layout for a batch of ``num_tokens`` tokens: ``"contiguous"`` or ``"masked"``.

    ``"auto"``: masked for ``num_tokens <= masked_max_tokens`` and contiguous above, also while a CUDA graph is
    captured (on ``hidden``'s stream: the sync-free contiguous layout captures too, and the masked one would hold
    ``E_local × num_tokens`` rows, ~40 GB for an 8192-token prefill graph of 257 local experts); always masked under
    ``torch.compile`` (the contiguous dispatch is hidden from dynamo) and during capture with ``contiguous_sync``
    (a host sync cannot be captured). An explicit ``"masked"`` / ``"contiguous"`` is returned as given; an
    explicit ``"contiguous"`` during capture raises with ``contiguous_sync``.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    capturing = hidden is not None and _stream_capturing(hidden)
    if path == "contiguous" and capturing and contiguous_sync:
        raise ValueError("path='contiguous' with contiguous_sync=True cannot run inside CUDA graph capture (it "
                         "syncs with the host to size its layout); use path='masked' or 'auto', or "
                         "contiguous_sync=False")
    if path != "auto":
        return path
    if num_tokens <= masked_max_tokens or torch.compiler.is_compiling() or (capturing and contiguous_sync):
        return "masked"
    return "contiguous"


def masked_expected_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The grouped GEMMs' ``expected_m`` hint: mean copies per global expert (speed only, never the result)."""
    return max(1, ceil_div(num_tokens * top_k, num_experts))


# On since session 17, when the fused epilogue moved to MUFU exp2 / reciprocal and a multiply by the scale's
# reciprocal (it had run ~2k instructions of IEEE divisions and expf per thread per tile on the math
# warpgroups). H100, DeepSeek-V3 EP rank, CUDA-graph timed, fused vs plain GEMM1 + SiLU·mul + quant:
# 362 vs 376 + 20 us at 2048 tokens, 560-582 vs 552-558 + 50-54 at 8192, 991 vs 947 + 77 at 16384; masked
# 300 / 330 / 331 vs 306 / 338 / 340 at 64 / 256 / 512 tokens (docs/kernels/gemm.md). Before, the fused
# kernel lost by up to 45%. False restores the two kernels (for A/B measurements).
FUSE_GEMM1_ACT = True


def _fused_gemm1(w13: Tensor) -> bool:
    """GEMM1 and SiLU·mul + quant in one kernel: where enabled (``FUSE_GEMM1_ACT``) and
    ``fp8_grouped_gemm_silu_mul_quant`` runs on Hopper. Elsewhere that op is the two ops in turn, and the
    explicit steps keep ``h`` in the decode workspace instead of a per-call buffer."""
    return (FUSE_GEMM1_ACT and w13.shape[1] % 256 == 0
            and backends.selected("fp8_grouped_gemm_silu_mul_quant", w13.device) == "hopper")


def grouped_experts_contiguous(a_fp8: Tensor, a_scale: Tensor, m_indices: Tensor, w13: Tensor, w13_scale: Tensor,
                               w2: Tensor, w2_scale: Tensor, *, ue8m0: bool = False,
                               mark: Callable[[str], None] | None = None, m_total: Tensor | None = None,
                               expected_m: int | None = None) -> Tensor:
    """The expert MLPs on a dispatched contiguous batch: GEMM (w13) → SiLU·mul + quant → GEMM (w2).

    ``a_fp8 [M_total, H]`` / ``a_scale`` and ``m_indices`` as ``dispatch_contiguous`` returns them; weights
    as ``Fp8FusedMoE``'s parameters (``[E_local, ...]``). ``m_total``: the device row count of a sync-free
    dispatch's upper-bound layout (every op then stops there). ``expected_m``: the rows per expert the
    caller expects (the GEMMs' block-shape hint). Returns ``y [M_total, H]`` bf16 (rows past ``m_total``
    unspecified). ``mark(stage)`` is called after each stage (``StageTimer``).
    """
    if _fused_gemm1(w13):
        y_fp8, y_scale = fp8_grouped_gemm_silu_mul_quant(a_fp8, a_scale, w13, w13_scale, m_indices=m_indices,
                                                         ue8m0=ue8m0, m_total=m_total, expected_m=expected_m)
        if mark is not None:
            mark("gemm1")
    else:
        h = fp8_grouped_gemm_contiguous(a_fp8, a_scale, w13, w13_scale, m_indices, m_total=m_total,
                                        expected_m=expected_m)
        if mark is not None:
            mark("gemm1")
        y_fp8, y_scale = silu_mul_per_token_group(h, ue8m0=ue8m0, masked_m=m_total)
    if mark is not None:
        mark("act_quant")
    y = fp8_grouped_gemm_contiguous(y_fp8, y_scale, w2, w2_scale, m_indices, m_total=m_total, expected_m=expected_m)
    if mark is not None:
        mark("gemm2")
    return y


def grouped_experts_masked(a_fp8: Tensor, a_scale: Tensor, masked_m: Tensor, expected_m: int, w13: Tensor,
                           w13_scale: Tensor, w2: Tensor, w2_scale: Tensor, out: Tensor | None = None, *,
                           ue8m0: bool = False, mark: Callable[[str], None] | None = None,
                           bufs: MaskedBuffers | None = None) -> Tensor:
    """The expert MLPs on an already dispatched masked batch: GEMM (w13) → SiLU·mul + quant → GEMM (w2).

    ``a_fp8 [E_local, max_m, H]``, ``a_scale [E_local, max_m, ceil(H/128)]`` (3-D TMA layout), ``masked_m``
    int32 ``[E_local]`` on the device, ``expected_m`` a host hint. Returns ``out`` (or ``bufs.y``, or a new
    tensor) ``bf16 [E_local, max_m, H]``; rows ``>= masked_m[e]`` are unspecified. No host sync. ``bufs``:
    a ``MaskedWorkspace`` view to write the intermediates into (CUDA-graph decode). Engines whose
    all-to-all delivers this layout (vLLM's batched format) call it directly.
    """
    y_dst = {} if bufs is None else {"out": bufs.y_fp8, "out_scale": bufs.y_scale}
    fused = _fused_gemm1(w13)
    if bufs is not None and fused != (bufs.h is None):  # its regions would alias GEMM1's input and output
        raise ValueError(f"grouped_experts_masked: the workspace was built for fused_gemm1={not fused}, this "
                         f"call runs fused_gemm1={fused} (FUSE_GEMM1_ACT changed?)")
    if fused:
        y_fp8, y_scale = fp8_grouped_gemm_silu_mul_quant(a_fp8, a_scale, w13, w13_scale, masked_m=masked_m,
                                                         expected_m=expected_m, ue8m0=ue8m0, **y_dst)
        if mark is not None:
            mark("gemm1")
    else:
        h = fp8_grouped_gemm_masked(a_fp8, a_scale, w13, w13_scale, masked_m, expected_m,
                                    out=None if bufs is None else bufs.h)
        if mark is not None:
            mark("gemm1")
        y_fp8, y_scale = silu_mul_per_token_group(h, ue8m0=ue8m0, masked_m=masked_m, **y_dst)
    if mark is not None:
        mark("act_quant")
    if out is None and bufs is not None:
        out = bufs.y
    y = fp8_grouped_gemm_masked(y_fp8, y_scale, w2, w2_scale, masked_m, expected_m, out=out)
    if mark is not None:
        mark("gemm2")
    return y


def experts_contiguous(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, w13: Tensor, w13_scale: Tensor,
                       w2: Tensor, w2_scale: Tensor, num_local_experts: int,
                       expert_map: Tensor | None = None, *, ue8m0: bool = False,
                       sync: bool = False, num_experts: int | None = None) -> tuple[Tensor, Tensor]:
    """Routed experts on the contiguous layout (prefill): ``dispatch_contiguous`` then
    ``grouped_experts_contiguous``.

    ``x_fp8 [T, H]`` / ``x_scale`` (``per_token_group``), ``topk_ids [T, top_k]`` (global ids when
    ``expert_map`` is given). Returns ``(y [M, H] bf16, row_map [T, top_k])`` for ``combine``. No host
    sync: ``M`` is the upper bound and the real row count stays on the device; ``sync=True`` sizes the
    layout exactly (``M = M_total``) with one sync (see ``Fp8FusedMoE``'s ``contiguous_sync``).
    ``num_experts``: the global E, for the GEMMs' ``expected_m`` hint as ``experts_masked`` (None: no hint).
    """
    if num_experts is not None:
        check_int("num_experts", num_experts, min_value=1)
    a, a_scale, m_indices, row_map, m_total = dispatch_contiguous(x_fp8, x_scale, topk_ids, num_local_experts,
                                                                  expert_map, sync=sync, return_m_total=True)
    hint = None if num_experts is None else masked_expected_m(x_fp8.shape[0], topk_ids.shape[1], num_experts)
    y = grouped_experts_contiguous(a, a_scale, m_indices, w13, w13_scale, w2, w2_scale, ue8m0=ue8m0,
                                   m_total=None if sync else m_total, expected_m=hint)
    return y, row_map


def experts_masked(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, w13: Tensor, w13_scale: Tensor,
                   w2: Tensor, w2_scale: Tensor, num_local_experts: int, num_experts: int,
                   expert_map: Tensor | None = None, *, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """Routed experts on the masked layout (decode; no host sync, CUDA-graph safe): ``dispatch_masked`` with
    ``max_m = T`` then ``grouped_experts_masked``. Arguments as ``experts_contiguous`` plus ``num_experts``
    (global E, for the ``expected_m`` hint). Returns ``(y [E_local, T, H] bf16, row_map [T, top_k])``."""
    check_int("num_experts", num_experts, min_value=1)
    t = x_fp8.shape[0]
    # max_m = T: a token picks distinct experts, so no expert can receive more than T copies and the
    # masked layout never drops one (the result equals the contiguous path's).
    a, a_scale, masked_m, row_map = dispatch_masked(x_fp8, x_scale, topk_ids, num_local_experts, t, expert_map)
    y = grouped_experts_masked(a, a_scale, masked_m, masked_expected_m(t, topk_ids.shape[1], num_experts),
                               w13, w13_scale, w2, w2_scale, ue8m0=ue8m0)
    return y, row_map


class Fp8FusedMoE(FixedDtypeModule):
    """Block-FP8 MoE layer: routing, dispatch, two grouped GEMMs with fused SiLU·mul, combine, shared experts.

    Args:
        num_experts: global routed expert count E (width of ``router_logits``).
        hidden_size: H, a positive multiple of 16.
        intermediate_size: I held by this module (per rank under tensor parallelism), a positive multiple
            of 128 (gate and up each own whole scale blocks of the fused ``w13``).
        top_k: experts per token.
        scoring_func, renormalize, n_group, topk_group, routed_scaling_factor: routing, as
            ``moe_fp8.layers.select_experts`` (DeepSeek-V3: ``"sigmoid"``, True, 8, 4, 2.5).
        use_correction_bias: hold ``e_score_correction_bias [E]`` (fp32), added to the scores for selection.
        num_shared_experts: 0 or more shared experts, fused into one ``Fp8MLP`` (``shared_experts``) of
            intermediate size ``shared_intermediate_size`` (default ``num_shared_experts · intermediate_size``;
            give it explicitly when the shared experts are sharded differently).
        expert_map: optional global → local map ``[E]`` (tensor or ints): the experts of this rank get local
            ids ``0..E_local-1``, the others -1.
        masked_max_tokens: batches of at most this many tokens take the masked path under ``path="auto"``
            (default ``default_masked_max_tokens(E_local)``, measured; see ``MASKED_MAX_ROWS``); also the
            capacity of the persistent decode workspace (``MaskedWorkspace``): give at least the largest
            batch a CUDA graph is captured for, so every graph shares it.
        ue8m0: quantize activations with power-of-two (UE8M0) scales, as DeepSeek-V3.1 checkpoints
            (``quantization_config.scale_fmt = "ue8m0"``) expect; their weight scales are powers of two too.
        contiguous_sync: size the contiguous (prefill) path's layout exactly, with one host sync per
            forward. Default False: no host sync — the layout gets the upper bound ``T·top_k +
            E_local·127`` rows and the GEMMs and SiLU·mul + quant read the real row count on the device
            (``dispatch_contiguous(sync=False)``), so the host enqueues the whole forward without waiting.
            Costs no time, but memory: under expert parallelism (about ``T`` of the ``T·top_k`` copies are
            local) the activations take several times the exact layout's (~1.3 GB at 8192 tokens for
            a DeepSeek-V3 EP-8 rank, against ~0.2 GB).
        device: where to allocate the parameters (``"meta"`` allocates nothing).

    ``stage_hook``: None, or a callable (``StageTimer``) called with ``"start"`` and each name of ``STAGES``
    as the forward enqueues it (benchmarks; it adds one attribute test per stage when None).

    ``shared_overlap`` (default True): on the masked path on CUDA (``SHARED_OVERLAP_PATHS``: at prefill it measured
    no faster) the shared experts run on a side stream from the forward's start (with their own quantization of
    ``hidden``), beside routing, the dispatch and the routed GEMMs, and the combine waits for them; a CUDA graph
    captures them as a parallel branch. The result is the same bits as in line. False (and under torch.compile,
    or with a ``stage_hook``) runs them in line after the dispatch. DeepSeek-V3 at TP 8, one token: 35.6 µs against
    42.0 in line and 32.4 without shared experts (H200; docs/kernels/datapath.md, session 60).

    Parameters (DeepSeek-V3 names, stacked over local experts):
        ``w13_weight`` fp8 ``[E_local, 2I, H]`` (rows ``[gate | up]``), ``w13_weight_scale_inv`` fp32
        ``[E_local, 2I/128, ceil(H/128)]``, ``w2_weight`` fp8 ``[E_local, H, I]``, ``w2_weight_scale_inv``
        fp32 ``[E_local, ceil(H/128), I/128]``, ``e_score_correction_bias`` fp32 ``[E]`` when used, and
        ``shared_experts.{gate_up_proj, down_proj}`` (``Fp8Linear``) when there are shared experts.
        They start as zeros with unit scales: fill them with ``moe_fp8.layers.load_fused_moe`` or ``copy_``.
        Module-wide casts (``model.to(torch.bfloat16)``) leave them in these dtypes (``FixedDtypeModule``).
    """

    fixed_dtype_tensors = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv",
                           "e_score_correction_bias")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, *,
                 scoring_func: str = "softmax", renormalize: bool = True, n_group: int | None = None,
                 topk_group: int | None = None, routed_scaling_factor: float = 1.0,
                 use_correction_bias: bool = False, num_shared_experts: int = 0,
                 shared_intermediate_size: int | None = None,
                 expert_map: Tensor | Sequence[int] | None = None,
                 masked_max_tokens: int | None = None, ue8m0: bool = False, contiguous_sync: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        for name, value, minimum in (("num_experts", num_experts, 1), ("hidden_size", hidden_size, 1),
                                     ("intermediate_size", intermediate_size, 1),
                                     ("num_shared_experts", num_shared_experts, 0),
                                     ("masked_max_tokens", 0 if masked_max_tokens is None else masked_max_tokens, 0)):
            if not _is_int(value) or value < minimum:
                raise ValueError(f"Fp8FusedMoE: {name} must be an int >= {minimum}, got {value!r}")
        if hidden_size % K_ALIGN != 0:
            raise ValueError(f"Fp8FusedMoE: hidden_size must be a multiple of {K_ALIGN} (FP8 GEMM rows), "
                             f"got {hidden_size}")
        if intermediate_size % GROUP_K != 0:
            raise ValueError(f"Fp8FusedMoE: intermediate_size must be a multiple of {GROUP_K} (gate and up each "
                             f"own whole scale blocks of w13; shard I in multiples of {GROUP_K}), got "
                             f"{intermediate_size}")
        try:  # the options select_experts checks at every call, refused here at construction
            check_routing_options(num_experts, top_k, scoring_func, renormalize, n_group, topk_group,
                                    routed_scaling_factor)
        except (TypeError, ValueError) as e:
            raise type(e)(f"Fp8FusedMoE: {e}") from None

        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.renormalize = renormalize
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        if not isinstance(ue8m0, bool):
            raise ValueError(f"Fp8FusedMoE: ue8m0 must be a bool, got {ue8m0!r}")
        self.ue8m0 = ue8m0
        if not isinstance(contiguous_sync, bool):
            raise ValueError(f"Fp8FusedMoE: contiguous_sync must be a bool, got {contiguous_sync!r}")
        self.contiguous_sync = contiguous_sync
        self.stage_hook: Callable[[str], None] | None = None
        self.shared_overlap = True
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        # (device, GEMM output dtype, max_m, fused GEMM1) -> MaskedWorkspace; see the module doc and _workspace.
        self._workspaces: dict[tuple[torch.device, torch.dtype, int, bool], MaskedWorkspace] = {}

        self._expert_map_host = _parse_expert_map(expert_map, num_experts)
        if self._expert_map_host is None:
            self.num_local_experts = num_experts
            self.register_buffer("expert_map", None)
        else:
            self.num_local_experts = sum(v >= 0 for v in self._expert_map_host)
            self.register_buffer("expert_map", torch.tensor(self._expert_map_host, dtype=torch.int32,
                                                            device=device), persistent=False)
        self.masked_max_tokens = (default_masked_max_tokens(self.num_local_experts) if masked_max_tokens is None
                                  else masked_max_tokens)

        e, h, i = self.num_local_experts, hidden_size, intermediate_size
        hb, ib = ceil_div(h, GROUP_K), i // GROUP_K
        self.w13_weight = _frozen(torch.zeros((e, 2 * i, h), dtype=_FP8, device=device))
        self.w13_weight_scale_inv = _frozen(torch.ones((e, 2 * ib, hb), dtype=torch.float32, device=device))
        self.w2_weight = _frozen(torch.zeros((e, h, i), dtype=_FP8, device=device))
        self.w2_weight_scale_inv = _frozen(torch.ones((e, hb, ib), dtype=torch.float32, device=device))
        if use_correction_bias:
            self.e_score_correction_bias = _frozen(torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.register_parameter("e_score_correction_bias", None)

        if num_shared_experts > 0:
            shared_i = shared_intermediate_size or num_shared_experts * intermediate_size
            self.shared_experts: Fp8MLP | None = Fp8MLP(hidden_size, shared_i, ue8m0=ue8m0, device=device)
        elif shared_intermediate_size:
            raise ValueError("Fp8FusedMoE: shared_intermediate_size given without num_shared_experts")
        else:
            self.shared_experts = None

    # ------------------------------------------------------------------------------------------
    def local_expert_ids(self) -> list[int]:
        """Global id of each local expert, in local order (``[0..E-1]`` without an expert map)."""
        if self._expert_map_host is None:
            return list(range(self.num_experts))
        ids = [0] * self.num_local_experts
        for global_id, local_id in enumerate(self._expert_map_host):
            if local_id >= 0:
                ids[local_id] = global_id
        return ids

    def choose_path(self, num_tokens: int, hidden: Tensor | None = None, path: str = "auto") -> str:
        """The dispatch layout a forward of ``num_tokens`` tokens uses: ``"contiguous"`` or ``"masked"``
        (``choose_dispatch_path`` with this layer's ``masked_max_tokens``)."""
        return choose_dispatch_path(num_tokens, self.masked_max_tokens, hidden, path,
                                    contiguous_sync=self.contiguous_sync)

    def forward(self, hidden: Tensor, router_logits: Tensor, *, path: str = "auto") -> Tensor:
        """``hidden [T, H]`` (bf16/fp16/fp32, contiguous) and ``router_logits [T, E]`` → ``[T, H]`` in hidden's dtype.

        ``path``: ``"auto"`` (see ``choose_path``), or force ``"contiguous"`` / ``"masked"`` (both give the
        same result; tests compare them). Under expert / tensor parallelism the result is this rank's
        partial sum.
        """
        if not isinstance(hidden, Tensor) or hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"Fp8FusedMoE: hidden must be [T, {self.hidden_size}], got "
                             f"{tuple(getattr(hidden, 'shape', ()))}")
        if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"Fp8FusedMoE: hidden must be bfloat16, float16 or float32, got {hidden.dtype}")
        t = hidden.shape[0]
        if (not isinstance(router_logits, Tensor) or router_logits.dim() != 2
                or tuple(router_logits.shape) != (t, self.num_experts)):
            raise ValueError(f"Fp8FusedMoE: router_logits must be [T, E] = [{t}, {self.num_experts}], got "
                             f"{tuple(getattr(router_logits, 'shape', ()))}")
        if router_logits.device != hidden.device:
            raise ValueError(f"Fp8FusedMoE: router_logits on {router_logits.device}, hidden on {hidden.device}")
        chosen = self.choose_path(t, hidden, path)
        mark = self.stage_hook
        if mark is not None:
            mark("start")

        side = self._side_stream(hidden, chosen)
        if side is not None:
            shared = self._fork_shared(side, hidden)
        topk_weights, topk_ids = self.route(router_logits)
        if mark is not None:
            mark("routing")
            mark("quant")  # fused into the dispatch: an empty stage (see STAGES)
        experts = self._experts_contiguous if chosen == "contiguous" else self._experts_masked
        y, row_map, shared_inline = experts(hidden, topk_ids, mark, shared_apart=side is not None)
        if side is not None:
            main = torch.cuda.current_stream(hidden.device)
            main.wait_stream(side)
            shared.record_stream(main)  # allocated on the side stream, read by the combine on this one
        else:
            shared = shared_inline
        out = combine(y, row_map, topk_weights, shared)
        if mark is not None:
            mark("combine")
        return out if out.dtype == hidden.dtype else out.to(hidden.dtype)

    def route(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        """``router_logits [T, E]`` → ``(topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32)``: the experts
        ``forward`` sends each token to (global ids) and their combine weights, under this layer's routing."""
        return select_experts(
            router_logits, self.top_k, scoring_func=self.scoring_func, renormalize=self.renormalize,
            n_group=self.n_group, topk_group=self.topk_group,
            e_score_correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor)

    def _side_stream(self, hidden: Tensor, path: str) -> torch.cuda.Stream | None:
        """The stream the shared experts run on beside the routed ones, or None to run them in line: only on the
        paths of ``SHARED_OVERLAP_PATHS`` on CUDA, outside torch.compile, and without a stage hook (whose stages
        must add up)."""
        if (self.shared_experts is None or not self.shared_overlap or path not in SHARED_OVERLAP_PATHS
                or not hidden.is_cuda or self.stage_hook is not None or torch.compiler.is_compiling()):
            return None
        side = self._side_streams.get(hidden.device)
        if side is None:
            side = self._side_streams[hidden.device] = torch.cuda.Stream(hidden.device)
        return side

    def _fork_shared(self, side: torch.cuda.Stream, hidden: Tensor) -> Tensor:
        """Enqueue the shared experts of ``hidden`` (their own quantization of it first) on ``side`` after what the
        current stream has enqueued; the caller joins ``side`` before it reads the result."""
        side.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(side), few_rows.beside_few_rows():
            return self.shared_experts.forward_fp8(*per_token_group(hidden, ue8m0=self.ue8m0))

    def _run_shared(self, x_fp8: Tensor | None, x_scale: Tensor | None, mark: Callable[[str], None] | None) -> Tensor | None:
        # NOTE: enqueued after the dispatch, not before it: with contiguous_sync the dispatch waits for the
        # host (M_total), and this way that sync does not wait for the shared experts' GEMMs, which then run
        # while the host prepares the routed GEMMs' launches instead of leaving the GPU idle.
        if self.shared_experts is None:
            return None
        # right before the routed GEMMs: the few-rows kernel's rule for GEMMs next to it (see beside_few_rows)
        with contextlib.nullcontext() if torch.compiler.is_compiling() else few_rows.beside_few_rows():
            shared = self.shared_experts.forward_fp8(x_fp8, x_scale)
        if mark is not None:
            mark("shared")
        return shared

    def _experts_contiguous(self, hidden: Tensor, topk_ids: Tensor, mark: Callable[[str], None] | None = None, *,
                            shared_apart: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        # quantization + dispatch in one op; the quantized input itself only for the shared experts.
        # Sync-free: the layout has the upper-bound rows and the device M_total bounds every op after it.
        sync = self.contiguous_sync
        x_fp8, x_scale, a, a_scale, m_indices, row_map, m_total = quant_dispatch_contiguous(
            hidden, topk_ids, self.num_local_experts, self.expert_map, ue8m0=self.ue8m0,
            return_x=self.shared_experts is not None and not shared_apart, sync=sync, return_m_total=True)
        if mark is not None:
            mark("dispatch")
        shared = None if shared_apart else self._run_shared(x_fp8, x_scale, mark)
        # the expected rows per expert pick the GEMMs' tiles (M_total is only an upper bound without the sync)
        y = grouped_experts_contiguous(a, a_scale, m_indices, self.w13_weight, self.w13_weight_scale_inv,
                                       self.w2_weight, self.w2_weight_scale_inv, ue8m0=self.ue8m0, mark=mark,
                                       m_total=None if sync else m_total,
                                       expected_m=masked_expected_m(hidden.shape[0], self.top_k, self.num_experts))
        return y, row_map, shared

    def _workspace(self, device: torch.device, num_tokens: int) -> MaskedWorkspace | None:
        """The persistent masked workspace for a batch of ``num_tokens`` on ``device``, or None where the
        batch is larger than its capacity (``masked_max_tokens``) or the forward is being compiled (the
        compiled graph allocates its own intermediates)."""
        max_m = self.masked_max_tokens
        if num_tokens > max_m or num_tokens == 0 or torch.compiler.is_compiling():
            return None
        fused = _fused_gemm1(self.w13_weight)
        key = (device, torch.bfloat16, max_m, fused)
        ws = self._workspaces.get(key)
        if ws is None:
            # Workspaces of another device belong to weights that have moved: drop them. Same-device ones
            # (another max_m) are kept, since a CUDA graph captured earlier may still write into them.
            self._workspaces = {k: v for k, v in self._workspaces.items() if k[0] == device}
            ws = self._workspaces[key] = MaskedWorkspace(self.num_local_experts, self.hidden_size,
                                                         self.intermediate_size, max_m, device, fused_gemm1=fused)
        return ws

    def release_workspaces(self) -> None:
        """Free the persistent decode workspaces (they are reallocated on the next masked forward). Only
        safe once no captured CUDA graph that used them will be replayed."""
        self._workspaces = {}

    def _experts_masked(self, hidden: Tensor, topk_ids: Tensor, mark: Callable[[str], None] | None = None, *,
                        shared_apart: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        t = hidden.shape[0]
        max_m = t  # see experts_masked
        ws = self._workspace(hidden.device, t)
        bufs = ws.views(t) if ws is not None else None
        # quantization + dispatch in one op (one launch at decode); x_fp8 / x_scale feed the shared experts
        x_fp8, x_scale, a, a_scale, masked_m, row_map = quant_dispatch_masked(
            hidden, topk_ids, self.num_local_experts, max_m, self.expert_map, ue8m0=self.ue8m0,
            out=None if bufs is None else bufs.a_fp8, out_scale=None if bufs is None else bufs.a_scale)
        if mark is not None:
            mark("dispatch")
        shared = None if shared_apart else self._run_shared(x_fp8, x_scale, mark)
        y = grouped_experts_masked(a, a_scale, masked_m, masked_expected_m(t, self.top_k, self.num_experts),
                                   self.w13_weight, self.w13_weight_scale_inv, self.w2_weight,
                                   self.w2_weight_scale_inv, ue8m0=self.ue8m0, mark=mark, bufs=bufs)
        return y, row_map, shared

    def extra_repr(self) -> str:
        parts = [f"num_experts={self.num_experts}", f"local={self.num_local_experts}",
                 f"hidden_size={self.hidden_size}", f"intermediate_size={self.intermediate_size}",
                 f"top_k={self.top_k}", f"scoring_func={self.scoring_func!r}"]
        if self.n_group is not None:
            parts.append(f"n_group={self.n_group}, topk_group={self.topk_group}")
        return ", ".join(parts)
