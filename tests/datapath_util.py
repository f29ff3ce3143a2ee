"""Shared by the data-path kernel tests (tests/test_datapath_*.py): device, interpreter probe, comparisons.

``DEVICE`` is ``cuda`` where a GPU is visible (compiled kernels) and ``cpu`` elsewhere, where
``tests/conftest.py`` has switched Triton's interpreter on. Tests without the ``gpu`` marker run on
both (keep them small: the interpreter runs a program in ~1 ms per small op); tests marked ``gpu``
use realistic sizes and run on the GPU machine only.
"""

from __future__ import annotations

import functools

import pytest
import torch

from moe_fp8.utils import is_scale_tma_layout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def poison_empty(monkeypatch, byte: int) -> None:
    """Every CUDA ``torch.empty`` of the test filled with ``byte``, so nothing a kernel leaves unwritten can match
    the reference by chance."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_cuda and t.numel():
            t.view(torch.uint8).fill_(byte)
        return t

    monkeypatch.setattr(torch, "empty", empty)


@functools.cache
def interpreter_problem() -> str | None:
    """Why the kernels cannot run on CPU here (None when they can, or when a GPU runs them)."""
    if DEVICE == "cuda":
        return None
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # pragma: no cover - triton is in the test extra
        return f"triton is not importable ({exc})"
    from moe_fp8.kernels.triton.common import interpreting

    if not interpreting():
        return "TRITON_INTERPRET was not on when Triton kernels were imported"

    @triton.jit
    def probe(x_ptr, n):
        acc = tl.zeros([16], dtype=tl.float64)
        for _ in range(0, n):  # runtime-bounded loop: what old interpreters + numpy >= 2.4 break
            acc += tl.exp(tl.load(x_ptr + tl.arange(0, 16)).to(tl.float64))
        tl.store(x_ptr + tl.arange(0, 16), acc.to(tl.float32))

    try:
        probe[(1,)](torch.zeros(16), 2)
    except Exception as exc:
        return (f"Triton {triton.__version__}'s interpreter cannot run the kernels here "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    return None


def make_expert_map(num_global: int, num_local: int, seed: int) -> torch.Tensor:
    """Global → local ids: a random ``num_local`` of the global experts live here, in random order."""
    gen = torch.Generator().manual_seed(seed)
    emap = torch.full((num_global,), -1, dtype=torch.int64)
    emap[torch.randperm(num_global, generator=gen)[:num_local]] = torch.randperm(num_local, generator=gen)
    return emap.to(DEVICE)


def require_kernels() -> None:
    """Skip the calling test (module-level: ``pytestmark``-like use) when the kernels cannot run."""
    why = interpreter_problem()
    if why:
        pytest.skip(why)


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality, except that any NaN equals any NaN (torch and the kernels may pick different
    NaN payloads). FP8 tensors are compared as raw bytes (their NaN is the single code 0x7F/0xFF)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype == torch.float8_e4m3fn:
        got, want = fp8_bytes(got), fp8_bytes(want)
        bad = got != want
    elif got.is_floating_point():
        g, w = got.float(), want.float()
        both_nan = torch.isnan(g) & torch.isnan(w)
        same = (g.view(torch.int32) == w.view(torch.int32)) if got.dtype == torch.float32 else (g == w) & (
            torch.signbit(g) == torch.signbit(w))
        bad = ~(same | both_nan)
    else:
        bad = got != want
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at {idx}: "
                             f"got {got[bad][:5].tolist()}, want {want[bad][:5].tolist()}")


def _diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DESIGN §6: ``1 - 2·Σxy / Σ(x² + y²)`` in float64."""
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum()
    return 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)


def check_silu_close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                     group_size: int = 128, rows_mask: torch.Tensor | None = None,
                     max_code_frac: float = 1e-4) -> None:
    """The FP32 SiLU path against the float64 reference (docs/kernels/datapath.md, "SiLU numerics")."""
    q, s = got
    rq, rs = want
    assert is_scale_tma_layout(s) and s.stride() == rs.stride()
    if rows_mask is not None:
        q, rq, s, rs = q[rows_mask], rq[rows_mask], s[rows_mask], rs[rows_mask]
    s, rs = s.reshape(-1, s.shape[-1]).float(), rs.reshape(-1, rs.shape[-1]).float()
    # scales: NaN / Inf exactly where the reference has them, finite ones to 2**-18 relative
    assert torch.equal(torch.isnan(s), torch.isnan(rs)), "NaN scales differ"
    fin = torch.isfinite(rs)
    assert torch.equal(s[~fin & ~torch.isnan(rs)], rs[~fin & ~torch.isnan(rs)]), "Inf scales differ"
    rel = ((s[fin] - rs[fin]).abs() / rs[fin]).max() if fin.any() else torch.tensor(0.0)
    pow2_jump = (s[fin] / rs[fin]).log2().abs().eq(1.0)  # ue8m0: amax an ulp across a power of two
    close = ((s[fin] - rs[fin]).abs() <= 2.0**-18 * rs[fin]) | pow2_jump
    assert close.all() and int(pow2_jump.sum()) <= max(1, fin.sum() // 1000), f"scales: max rel {float(rel)}"
    # codes: identical but for rare one-step differences (same sign, adjacent magnitudes)
    qb, rqb = q.reshape(-1, q.shape[-1]).view(torch.uint8).int(), rq.reshape(-1, rq.shape[-1]).view(torch.uint8).int()
    bad = qb != rqb
    n_bad = int(bad.sum())
    assert n_bad <= max(2, int(max_code_frac * qb.numel())), f"{n_bad} of {qb.numel()} FP8 codes differ"
    if n_bad:
        a, b = qb[bad], rqb[bad]
        one_step = ((a & 0x80) == (b & 0x80)) & ((a & 0x7F) - (b & 0x7F)).abs().eq(1)
        assert one_step.all(), f"codes differ by more than one step: {a[~one_step][:5].tolist()} vs " \
                               f"{b[~one_step][:5].tolist()}"
    # dequantized values (finite groups): DESIGN §6 diff
    expand = torch.repeat_interleave(torch.arange(s.shape[-1], device=s.device), group_size)[: qb.shape[-1]]
    deq = q.reshape(qb.shape).float() * s[:, expand]
    rdeq = rq.reshape(qb.shape).float() * rs[:, expand]
    ok = torch.isfinite(rdeq).all(dim=1) & torch.isfinite(deq).all(dim=1)
    assert _diff(deq[ok], rdeq[ok]) < 1e-5


def check_routing(got, want, renormalize: bool) -> None:
    """``select_experts`` output vs the reference's: ids bit-equal; weights bit-equal, or within a few
    ulps with ``renormalize`` (the sum of the top-k weights is taken in another order than torch's)."""
    (w, ids), (rw, rids) = got, want
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert_same_bits(ids, rids, "topk_ids")
    if not renormalize:
        assert_same_bits(w, rw, "topk_weights")
        return
    nan = torch.isnan(rw)
    assert torch.equal(torch.isnan(w), nan)
    torch.testing.assert_close(w[~nan], rw[~nan], rtol=2.0**-21, atol=0)
