"""Fp8Linear, Fp8MLP and Fp8FusedMoE against plain PyTorch with the dequantized weights (DESIGN §6:
layer vs bf16 layer ``calc_diff < 2e-3``), contiguous == masked, expert / tensor parallel splits, errors.

The oracles here are written out in plain PyTorch (loops over tokens and experts in FP32 on the
unquantized activations); routing comes from ``moe_fp8.reference.select_experts``, itself checked
against a brute force in test_reference_moe.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_fp8 import backends, calc_diff, layers, quant
from moe_fp8 import reference as ref
from moe_fp8.layers import (
    Fp8FusedMoE,
    Fp8Linear,
    Fp8MLP,
    expert_map_for_rank,
    shard_fp8_linear,
    shard_moe_weights,
    tp_shard_range,
)
from moe_fp8.layers import moe as moe_module
from moe_fp8.testing import randn

LAYER_DIFF = 2e-3  # DESIGN §6: layer vs bf16 layer with dequantized weights


def _fp8_weight(shape: tuple[int, ...], seed: int, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    k = shape[-1]
    return quant.per_block(randn(shape, seed=seed) * (scale if scale is not None else k ** -0.5))


def _dq(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return quant.dequant_per_block(w, s)


# ----------------------------------------------------------------------------------------------
# Fp8Linear
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 256, 128, False), (37, 2112, 576, True),
                                                    (64, 160, 256, False), (5, 72, 48, True)])
def test_fp8_linear_matches_dequantized_linear(m, n, k, bias):
    lin = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(randn((n, k), seed=n + k) * k ** -0.5)
        if bias:
            lin.bias.copy_(randn((n,), seed=3))
    fp8 = Fp8Linear.from_float(lin)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight.shape == (n, k)
    assert fp8.weight_scale_inv.shape == ((n + 127) // 128, (k + 127) // 128)
    x = randn((2, m, k), seed=m)  # leading dims are kept
    out = fp8(x)
    assert out.shape == (2, m, n) and out.dtype == torch.bfloat16 and out.isfinite().all()
    w = _dq(fp8.weight, fp8.weight_scale_inv)
    expected = x.float() @ w.t() + (lin.bias.float() if bias else 0)
    assert calc_diff(out, expected) < LAYER_DIFF
    # Same FP8 inputs through the op directly: the layer adds nothing but the bias.
    x_fp8, x_scale = quant.per_token_group(x.reshape(-1, k))
    direct = ref.fp8_gemm(x_fp8, x_scale, fp8.weight, fp8.weight_scale_inv)
    if bias:
        direct = direct + lin.bias
    assert torch.equal(out.reshape(-1, n), direct)


def test_fp8_linear_dtypes_views_and_from_fp8():
    w, s = _fp8_weight((256, 128), seed=1)
    lin = Fp8Linear.from_fp8(w, s)
    x = randn((8, 128), seed=2, dtype=torch.float32)
    out32 = lin(x)
    assert out32.dtype == torch.float32
    # A strided view (as attention produces) gives the same result as its contiguous copy.
    wide = randn((8, 256), seed=2)
    assert torch.equal(lin(wide[:, ::2]), lin(wide[:, ::2].contiguous()))
    assert lin(torch.empty(0, 128, dtype=torch.bfloat16)).shape == (0, 256)


def test_module_casts_keep_fp8_weights_and_fp32_scales():
    """model.to(torch.bfloat16) / .half() / .float() cast activations' dtype, never the FP8 codes, the FP32 scales
    or the bias: the layers keep computing the same thing."""
    w, s = _fp8_weight((256, 128), seed=1)
    s.mul_(1 + 1e-6)  # a scale bf16 could not hold
    lin = Fp8Linear.from_fp8(w, s, torch.ones(256, dtype=torch.bfloat16))
    moe = Fp8FusedMoE(8, 128, 128, 2, num_shared_experts=1, use_correction_bias=True, scoring_func="sigmoid")
    moe.w13_weight_scale_inv.data.copy_(torch.rand_like(moe.w13_weight_scale_inv) + 0.5)
    x = randn((4, 128), seed=2)
    logits = randn((4, 8), seed=3, dtype=torch.float32)
    before = {id(m): {n: t.clone() for n, t in m.state_dict().items()} for m in (lin, moe)}
    out_lin, out_moe = lin(x), moe(x, logits)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(),
                 lambda m: m.to("cpu", torch.float16)):
        for module in (lin, moe):
            cast(module)
            for name, t in module.state_dict().items():
                old = before[id(module)][name]
                assert t.dtype == old.dtype and torch.equal(t.view(torch.uint8), old.view(torch.uint8)), name
    assert torch.equal(lin(x), out_lin) and torch.equal(moe(x, logits), out_moe)
    assert lin(x.half()).dtype == torch.float16


def test_fp8_linear_refuses_bad_shapes_and_inputs():
    with pytest.raises(ValueError, match="in_features"):
        Fp8Linear(100, 256)
    with pytest.raises(ValueError, match="out_features"):
        Fp8Linear(128, 12)
    lin = Fp8Linear(128, 256)
    with pytest.raises(ValueError, match=r"\[\.\.\., 128\]"):
        lin(torch.zeros(4, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        Fp8Linear.from_float(torch.nn.Conv1d(4, 4, 1))
    w, s = _fp8_weight((256, 128), seed=1)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        lin.load_fp8_(w, s[:1])
    with pytest.raises(ValueError, match="weight must be"):
        lin.load_fp8_(w.float(), s)


# ----------------------------------------------------------------------------------------------
# Fp8MLP
# ----------------------------------------------------------------------------------------------
def _mlp_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) · up(x))`` in FP32; w13 = [gate | up] rows, dequantized."""
    gate, up = (x.float() @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def test_fp8_mlp_matches_dequantized_mlp():
    h, i = 256, 384
    mlp = Fp8MLP(h, i)
    w13, s13 = _fp8_weight((2 * i, h), seed=5)
    w2, s2 = _fp8_weight((h, i), seed=6)
    mlp.gate_up_proj.load_fp8_(w13, s13)
    mlp.down_proj.load_fp8_(w2, s2)
    x = randn((3, 7, h), seed=7)
    out = mlp(x)
    assert out.shape == x.shape and out.isfinite().all()
    assert calc_diff(out, _mlp_reference(x, _dq(w13, s13), _dq(w2, s2))) < LAYER_DIFF
    with pytest.raises(ValueError, match="intermediate_size"):
        Fp8MLP(h, 200)


# ----------------------------------------------------------------------------------------------
# Fp8FusedMoE
# ----------------------------------------------------------------------------------------------
ROUTINGS = {
    "softmax": dict(scoring_func="softmax", renormalize=True),
    "softmax_no_renorm": dict(scoring_func="softmax", renormalize=False, routed_scaling_factor=1.5),
    "grouped_sigmoid": dict(scoring_func="sigmoid", renormalize=True, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, use_correction_bias=True),
}


class MoEWeights:
    """Random block-FP8 expert (and shared expert) weights of one MoE layer, with their dequantized forms."""

    def __init__(self, num_experts: int, hidden: int, inter: int, shared_inter: int = 0, seed: int = 0) -> None:
        self.w13, self.s13 = _fp8_weight((num_experts, 2 * inter, hidden), seed)
        self.w2, self.s2 = _fp8_weight((num_experts, hidden, inter), seed + 1)
        self.bias = 0.1 * randn((num_experts,), seed=seed + 2, dtype=torch.float32)
        self.shared = None
        if shared_inter:
            self.shared = (*_fp8_weight((2 * shared_inter, hidden), seed + 3),
                           *_fp8_weight((hidden, shared_inter), seed + 4))

    def fill(self, moe: Fp8FusedMoE) -> Fp8FusedMoE:
        with torch.no_grad():
            local = moe.local_expert_ids()
            for name, full in (("w13_weight", self.w13), ("w13_weight_scale_inv", self.s13),
                               ("w2_weight", self.w2), ("w2_weight_scale_inv", self.s2)):
                getattr(moe, name).copy_(full[local])
            if moe.e_score_correction_bias is not None:
                moe.e_score_correction_bias.copy_(self.bias)
            if moe.shared_experts is not None:
                moe.shared_experts.gate_up_proj.load_fp8_(*self.shared[:2])
                moe.shared_experts.down_proj.load_fp8_(*self.shared[2:])
        return moe


def ue8m0_weights(wts: MoEWeights) -> MoEWeights:
    """``wts`` requantized with power-of-two weight scales, as a V3.1 checkpoint has them."""
    wts.w13, wts.s13 = quant.per_block(quant.dequant_per_block(wts.w13, wts.s13), ue8m0=True)
    wts.w2, wts.s2 = quant.per_block(quant.dequant_per_block(wts.w2, wts.s2), ue8m0=True)
    if wts.shared is not None:
        wts.shared = tuple(t for w, s in (wts.shared[:2], wts.shared[2:])
                           for t in quant.per_block(quant.dequant_per_block(w, s), ue8m0=True))
    return wts


def moe_loop_reference(hidden: torch.Tensor, logits: torch.Tensor, wts: MoEWeights, top_k: int,
                       routing: dict) -> torch.Tensor:
    """Plain PyTorch MoE: route, then one token-expert pair at a time in FP32 (unquantized activations)."""
    kwargs = {k: v for k, v in routing.items() if k != "use_correction_bias"}
    if routing.get("use_correction_bias"):
        kwargs["e_score_correction_bias"] = wts.bias
    weights, ids = ref.select_experts(logits, top_k, **kwargs)
    w13, w2 = _dq(wts.w13, wts.s13), _dq(wts.w2, wts.s2)
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            out[t] += weights[t, j] * _mlp_reference(hidden[t:t + 1], w13[e], w2[e])[0]
    if wts.shared is not None:
        out += _mlp_reference(hidden, _dq(*wts.shared[:2]), _dq(*wts.shared[2:]))
    return out


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("shared", [False, True])
def test_fused_moe_contiguous_equals_masked_equals_loop(routing, shared):
    # 8 experts keep the CPU reference's contiguous GEMM (one product per expert over all rows) cheap.
    num_experts, hidden, inter, top_k, t = 8, 256, 128, 3, 23
    wts = MoEWeights(num_experts, hidden, inter, shared_inter=256 if shared else 0, seed=10)
    moe = wts.fill(Fp8FusedMoE(num_experts, hidden, inter, top_k, num_shared_experts=2 if shared else 0,
                               **ROUTINGS[routing]))
    x = randn((t, hidden), seed=11)
    logits = randn((t, num_experts), seed=12, dtype=torch.float32)
    contiguous = moe(x, logits, path="contiguous")
    masked = moe(x, logits, path="masked")
    assert contiguous.shape == (t, hidden) and contiguous.dtype == torch.bfloat16
    assert contiguous.isfinite().all()
    assert torch.equal(contiguous, masked)
    moe.contiguous_sync = True  # the exact layout (one host sync) instead of the upper bound
    assert torch.equal(moe(x, logits, path="contiguous"), contiguous)
    assert calc_diff(contiguous, moe_loop_reference(x, logits, wts, top_k, ROUTINGS[routing])) < LAYER_DIFF


def test_fused_moe_runs_every_step_through_public_ops(monkeypatch):
    """Each step dispatches through moe_fp8.backends (so GPU kernels run where they exist)."""
    selected = []
    real_select = backends.select

    def spy(op, device):
        selected.append(op)
        return real_select(op, device)

    wts = MoEWeights(8, 128, 128, shared_inter=128, seed=20)
    moe = wts.fill(Fp8FusedMoE(8, 128, 128, 2, num_shared_experts=1))
    x, logits = randn((5, 128), seed=21), randn((5, 8), seed=22)
    monkeypatch.setattr(backends, "select", spy)
    moe(x, logits, path="contiguous")
    # Quantization fused into the dispatch op; the shared experts go after the dispatch, so its host sync
    # (contiguous_sync=True) would not wait for them.
    # The layer asks whether fp8_grouped_gemm_silu_mul_quant runs on Hopper (moe.FUSE_GEMM1_ACT); on CPU
    # it does not, so GEMM1 and SiLU·mul + quant run as two ops.
    gemm1 = ["fp8_grouped_gemm_silu_mul_quant", "fp8_grouped_gemm_{}", "silu_mul_per_token_group_quant"]
    assert selected == ["select_experts", "quant_dispatch_contiguous", "fp8_gemm",
                        "silu_mul_per_token_group_quant", "fp8_gemm",
                        *(s.format("contiguous") for s in gemm1), "fp8_grouped_gemm_contiguous", "combine"]
    selected.clear()
    moe(x, logits, path="masked")
    # masked: the quantization is fused into the dispatch (one op), the shared experts read its x_fp8; the
    # decode workspace's layout depends on the GEMM1 form too (asked first)
    assert selected == ["select_experts", "fp8_grouped_gemm_silu_mul_quant", "quant_dispatch_masked", "fp8_gemm",
                        "silu_mul_per_token_group_quant", "fp8_gemm",
                        *(s.format("masked") for s in gemm1), "fp8_grouped_gemm_masked", "combine"]


def test_contiguous_path_passes_the_rows_hint(monkeypatch):
    """The contiguous path's grouped GEMMs get ``expected_m = ceil(T·top_k / E)`` (their block-shape hint): from
    the layer, and from ``experts_contiguous`` given the global E (the engines' path); none without it."""
    moe = MoEWeights(8, 128, 128, seed=35).fill(Fp8FusedMoE(8, 128, 128, 2))
    hints = []
    real = moe_module.fp8_grouped_gemm_contiguous

    def spy(*args, expected_m=None, **kwargs):
        hints.append(expected_m)
        return real(*args, expected_m=expected_m, **kwargs)

    monkeypatch.setattr(moe_module, "fp8_grouped_gemm_contiguous", spy)
    x, logits = randn((12, 128), seed=1), randn((12, 8), seed=2)
    out = moe(x, logits, path="contiguous")
    assert hints == [3, 3]  # GEMM1 and GEMM2 (unfused off Hopper): ceil(12 * 2 / 8)
    torch.testing.assert_close(out, moe(x, logits, path="masked"), rtol=0, atol=0)
    hints.clear()
    x_fp8, x_scale = quant.per_token_group(x)
    _, ids = moe.route(logits)
    weights = (moe.w13_weight, moe.w13_weight_scale_inv, moe.w2_weight, moe.w2_weight_scale_inv)
    moe_module.experts_contiguous(x_fp8, x_scale, ids, *weights, 8, num_experts=8)
    moe_module.experts_contiguous(x_fp8, x_scale, ids, *weights, 8)
    assert hints == [3, 3, None, None]
    # the global E (the hint's divisor) is checked before any work
    for bad, exc, pattern in ((0, ValueError, "num_experts must be >= 1, got 0"),
                              (8.0, TypeError, "num_experts must be an int")):
        with pytest.raises(exc, match=pattern):
            moe_module.experts_contiguous(x_fp8, x_scale, ids, *weights, 8, num_experts=bad)
        with pytest.raises(exc, match=pattern):
            moe_module.experts_masked(x_fp8, x_scale, ids, *weights, 8, bad)
    assert hints == [3, 3, None, None]


def test_fused_moe_auto_path_crossover(monkeypatch):
    moe = MoEWeights(8, 128, 128, seed=30).fill(Fp8FusedMoE(8, 128, 128, 2, masked_max_tokens=4))
    calls = []
    for name in ("_experts_contiguous", "_experts_masked"):
        real = getattr(Fp8FusedMoE, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Fp8FusedMoE, name, spy)
    for t in (1, 4, 5):
        moe(randn((t, 128), seed=t), randn((t, 8), seed=t + 1))
    assert calls == ["_experts_masked", "_experts_masked", "_experts_contiguous"]
    assert Fp8FusedMoE(8, 128, 128, 2).masked_max_tokens == moe_module.MASKED_MAX_ROWS // 8
    assert moe_module.default_masked_max_tokens(32) == 512  # the measured DeepSeek-V3 EP-rank case
    assert moe_module.default_masked_max_tokens(256) == 64
    # During CUDA graph capture (simulated): auto chooses by size as in eager (the masked buffers grow as
    # E_local x T); the contiguous path is taken without a host sync (the default). With contiguous_sync, auto
    # stays masked and an explicit contiguous is refused.
    monkeypatch.setattr(moe_module, "_stream_capturing", lambda t: True)
    assert moe.choose_path(4, torch.empty(0)) == "masked"
    assert moe.choose_path(10_000, torch.empty(0)) == "contiguous"
    assert moe.choose_path(10_000, torch.empty(0), "contiguous") == "contiguous"
    moe.contiguous_sync = True
    assert moe.choose_path(10_000, torch.empty(0)) == "masked"
    with pytest.raises(ValueError, match="CUDA graph capture"):
        moe.choose_path(10_000, torch.empty(0), "contiguous")


def test_fused_moe_empty_batch_and_fp32_hidden():
    moe = MoEWeights(8, 128, 128, shared_inter=128, seed=40).fill(
        Fp8FusedMoE(8, 128, 128, 2, num_shared_experts=1))
    for path in ("contiguous", "masked"):
        assert moe(torch.empty(0, 128, dtype=torch.bfloat16), torch.empty(0, 8), path=path).shape == (0, 128)
    x = randn((6, 128), seed=41, dtype=torch.float32)
    out = moe(x, randn((6, 8), seed=42))
    assert out.dtype == torch.float32 and out.isfinite().all()


@pytest.mark.parametrize("routing", ["softmax", "grouped_sigmoid"])
def test_expert_parallel_ranks_sum_to_full_output(routing):
    """Experts split over 2 simulated ranks (expert_map), shared experts tensor-split: the sum over ranks is
    the single-rank output, and each rank alone is not."""
    num_experts, hidden, inter, top_k, t = 16, 256, 128, 4, 19
    wts = MoEWeights(num_experts, hidden, inter, shared_inter=256, seed=50)
    kwargs = dict(num_shared_experts=1, shared_intermediate_size=256, **ROUTINGS[routing])
    full = wts.fill(Fp8FusedMoE(num_experts, hidden, inter, top_k, **kwargs))
    x = randn((t, hidden), seed=51)
    logits = randn((t, num_experts), seed=52, dtype=torch.float32)
    expected = full(x, logits)
    partial_sum = torch.zeros(t, hidden)
    for rank in range(2):
        moe = Fp8FusedMoE(num_experts, hidden, inter, top_k, expert_map=expert_map_for_rank(num_experts, rank, 2),
                          **{**kwargs, "shared_intermediate_size": 128})
        assert moe.num_local_experts == 8 and moe.w13_weight.shape == (8, 2 * inter, hidden)
        assert moe.local_expert_ids() == list(range(rank * 8, rank * 8 + 8))
        with torch.no_grad():
            for name, src in (("w13_weight", wts.w13), ("w13_weight_scale_inv", wts.s13), ("w2_weight", wts.w2),
                              ("w2_weight_scale_inv", wts.s2)):
                getattr(moe, name).copy_(src[rank * 8:(rank + 1) * 8])
            if moe.e_score_correction_bias is not None:
                moe.e_score_correction_bias.copy_(wts.bias)
            gu, gus, _ = shard_fp8_linear(*wts.shared[:2], rank, 2, mode="column", num_fused=2)
            d, ds, _ = shard_fp8_linear(*wts.shared[2:], rank, 2, mode="row")
            moe.shared_experts.gate_up_proj.load_fp8_(gu, gus)
            moe.shared_experts.down_proj.load_fp8_(d, ds)
        outs = {p: moe(x, logits, path=p) for p in ("contiguous", "masked")}
        assert torch.equal(outs["contiguous"], outs["masked"])
        moe.contiguous_sync = True
        assert torch.equal(moe(x, logits, path="contiguous"), outs["masked"])
        assert calc_diff(outs["contiguous"], expected) > 0.05  # one rank is only part of the answer
        partial_sum += outs["contiguous"].float()
    assert calc_diff(partial_sum, expected) < 1e-5


def test_expert_map_with_no_local_tokens():
    """A rank whose experts receive no token returns zeros (contiguous layout of 0 rows)."""
    moe = MoEWeights(8, 128, 128, seed=60).fill(
        Fp8FusedMoE(8, 128, 128, 1, expert_map=[-1, -1, -1, -1, -1, -1, 0, 1]))
    logits = torch.zeros(3, 8)
    logits[:, 0] = 10.0  # every token picks expert 0, which lives elsewhere
    for path in ("contiguous", "masked"):
        out = moe(randn((3, 128), seed=61), logits, path=path)
        assert torch.equal(out, torch.zeros_like(out))


def test_tensor_parallel_moe_shards_sum_to_full_output():
    num_experts, hidden, inter, top_k, t = 8, 256, 256, 2, 17
    wts = MoEWeights(num_experts, hidden, inter, seed=70)
    full = wts.fill(Fp8FusedMoE(num_experts, hidden, inter, top_k))
    x, logits = randn((t, hidden), seed=71), randn((t, num_experts), seed=72)
    expected = full(x, logits)
    total = torch.zeros(t, hidden)
    for rank in range(2):
        w13, s13, w2, s2 = shard_moe_weights(wts.w13, wts.s13, wts.w2, wts.s2, rank, 2)
        assert w13.shape == (num_experts, inter, hidden) and w2.shape == (num_experts, hidden, inter // 2)
        # gate rows of the shard are the rank's slice of gate, up rows the same slice of up
        assert torch.equal(w13[:, :128].view(torch.uint8), wts.w13[:, rank * 128:(rank + 1) * 128].view(torch.uint8))
        assert torch.equal(w13[:, 128:].view(torch.uint8),
                           wts.w13[:, inter + rank * 128:inter + (rank + 1) * 128].view(torch.uint8))
        moe = Fp8FusedMoE(num_experts, hidden, inter // 2, top_k)
        with torch.no_grad():
            for p, v in zip(("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv"),
                            (w13, s13, w2, s2), strict=True):
                getattr(moe, p).copy_(v)
        total += moe(x, logits).float()
    assert calc_diff(total, expected) < 1e-5


def test_fp8_linear_tensor_parallel_splits():
    n, k = 512, 384
    w, s = _fp8_weight((n, k), seed=80)
    bias = randn((n,), seed=81)
    full = Fp8Linear.from_fp8(w, s, bias)
    x = randn((9, k), seed=82)
    expected = full(x)
    cols = [Fp8Linear.from_fp8(*shard_fp8_linear(w, s, r, 2, mode="column", bias=bias))(x) for r in range(2)]
    assert torch.equal(torch.cat(cols, dim=-1), expected)  # column split: exact
    w3, s3 = _fp8_weight((n, 3 * 128), seed=83)
    row_sum = torch.zeros(9, n)
    full3 = Fp8Linear.from_fp8(w3, s3, bias)
    for r in range(3):
        ws, ss, b = shard_fp8_linear(w3, s3, r, 3, mode="row", bias=bias)
        assert ws.shape == (n, 128) and (b is None) == (r != 0)
        row_sum += Fp8Linear.from_fp8(ws, ss, b)(x[:, r * 128:(r + 1) * 128]).float()
    assert calc_diff(row_sum, full3(x)) < 1e-5
    # fused [gate | up] column split keeps [gate_r | up_r]
    g, gs, _ = shard_fp8_linear(w, s, 1, 2, mode="column", num_fused=2)
    assert torch.equal(g.view(torch.uint8), torch.cat([w[128:256], w[384:512]]).view(torch.uint8))
    assert torch.equal(gs, torch.cat([s[1:2], s[3:4]]))


def test_parallel_helpers_refuse_bad_splits():
    assert tp_shard_range(512, 1, 2) == (256, 512)
    assert tp_shard_range(200, 0, 1) == (0, 200)  # no split: any size
    with pytest.raises(ValueError, match="multiple of 128"):
        tp_shard_range(384, 0, 2)
    with pytest.raises(ValueError, match="tp_rank"):
        tp_shard_range(512, 2, 2)
    w13, s13 = _fp8_weight((2, 2 * 384, 128), seed=90)
    w2, s2 = _fp8_weight((2, 128, 384), seed=91)
    with pytest.raises(ValueError, match="intermediate size I = 384"):
        shard_moe_weights(w13, s13, w2, s2, 0, 2)
    with pytest.raises(ValueError, match="disagree"):
        shard_moe_weights(w13, s13, w13, s13, 0, 1)
    with pytest.raises(TypeError, match="float8"):
        shard_fp8_linear(w13[0].float(), s13[0], 0, 2, mode="column")
    with pytest.raises(ValueError, match="mode"):
        shard_fp8_linear(w13[0], s13[0], 0, 2, mode="diagonal")
    with pytest.raises(ValueError, match="ep_size"):
        expert_map_for_rank(10, 0, 4)


def test_fused_moe_refuses_bad_configs_and_inputs():
    with pytest.raises(TypeError, match=r"Fp8FusedMoE: hidden must be bfloat16, float16 or float32, got torch\.int32"):
        Fp8FusedMoE(8, 128, 128, 2)(torch.zeros(3, 128, dtype=torch.int32), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="intermediate_size must be a multiple of 128"):
        Fp8FusedMoE(8, 128, 192, 2)
    with pytest.raises(ValueError, match="hidden_size"):
        Fp8FusedMoE(8, 100, 128, 2)
    with pytest.raises(ValueError, match="top_k"):
        Fp8FusedMoE(8, 128, 128, 9)
    with pytest.raises(ValueError, match="scoring_func"):
        Fp8FusedMoE(8, 128, 128, 2, scoring_func="relu")
    with pytest.raises(ValueError, match="n_group"):
        Fp8FusedMoE(8, 128, 128, 2, n_group=3, topk_group=1)
    # routing options are refused at construction, as select_experts refuses them at every call
    with pytest.raises(ValueError, match="Fp8FusedMoE: topk_group must be <= 4"):
        Fp8FusedMoE(8, 128, 128, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match=r"Fp8FusedMoE: top_k must be <= topk_group \* E / n_group = 2"):
        Fp8FusedMoE(8, 128, 128, 3, n_group=4, topk_group=1)
    with pytest.raises(TypeError, match="Fp8FusedMoE: renormalize must be a bool"):
        Fp8FusedMoE(8, 128, 128, 2, renormalize="no")
    with pytest.raises(ValueError, match="Fp8FusedMoE: routed_scaling_factor must be finite"):
        Fp8FusedMoE(8, 128, 128, 2, routed_scaling_factor=float("nan"))
    with pytest.raises(ValueError, match="local ids"):
        Fp8FusedMoE(4, 128, 128, 2, expert_map=[0, 0, 1, -1])
    with pytest.raises(ValueError, match="4 ints"):
        Fp8FusedMoE(4, 128, 128, 2, expert_map=[0, 1])
    with pytest.raises(ValueError, match="no experts"):
        Fp8FusedMoE(4, 128, 128, 2, expert_map=[-1, -1, -1, -1])
    with pytest.raises(ValueError, match="contiguous_sync must be a bool"):
        Fp8FusedMoE(8, 128, 128, 2, contiguous_sync=1)
    moe = Fp8FusedMoE(8, 128, 128, 2)
    x = randn((4, 128), seed=1)
    with pytest.raises(ValueError, match=r"hidden must be \[T, 128\]"):
        moe(x[:, :64], torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"router_logits must be \[T, E\] = \[4, 8\]"):
        moe(x, torch.zeros(4, 7))
    with pytest.raises(ValueError, match="path"):
        moe(x, torch.zeros(4, 8), path="fast")


def test_layers_public_names():
    for name in ("Fp8Linear", "Fp8MLP", "Fp8FusedMoE", "shard_moe_weights", "shard_fp8_linear", "load_fused_moe",
                 "load_fp8_linear", "CheckpointReader", "write_deepseek_v3_checkpoint", "MASKED_MAX_ROWS",
                 "default_masked_max_tokens"):
        assert name in layers.__all__ and hasattr(layers, name)


@pytest.mark.hopper
def test_fused_moe_on_hopper_matches_reference_and_replays_in_cuda_graph():
    """On sm_90: the GEMMs run the Hopper kernels; both paths match the CPU reference run of the same layer
    (same FP8 inputs, DESIGN §6 kernel bound), and the auto path captures into a CUDA graph (masked layout,
    no host sync) that replays correctly with new tokens and a new routing."""
    import copy

    import moe_fp8

    wts = MoEWeights(16, 256, 128, shared_inter=128, seed=100)
    cpu = wts.fill(Fp8FusedMoE(16, 256, 128, 4, num_shared_experts=1, **ROUTINGS["grouped_sigmoid"]))
    gpu = copy.deepcopy(cpu).cuda()
    assert gpu.w13_weight.is_cuda and gpu.e_score_correction_bias.is_cuda
    for op in ("fp8_gemm", "fp8_grouped_gemm_contiguous", "fp8_grouped_gemm_masked"):
        assert moe_fp8.backend(op, "cuda") == "hopper"
    t = 24
    x, logits = randn((t, 256), seed=101), randn((t, 16), seed=102, dtype=torch.float32)
    for path in ("contiguous", "masked"):
        out = gpu(x.cuda(), logits.cuda(), path=path)
        assert out.isfinite().all()
        # the GPU routing weights differ from the CPU ones by a few ulps (sum order), which can move an
        # FP8 rounding of the SiLU·mul output: measured 1.7e-5; a wrong expert or scale gives > 1e-2
        assert calc_diff(out.cpu(), cpu(x, logits, path=path)) < 1e-4
    # the sync-free contiguous layout (upper bound, device M_total) computes each row as the exact one
    gpu.contiguous_sync = True
    exact = gpu(x.cuda(), logits.cuda(), path="contiguous")
    gpu.contiguous_sync = False
    assert torch.equal(exact, gpu(x.cuda(), logits.cuda(), path="contiguous"))

    static_x, static_logits = x.cuda(), logits.cuda()
    gpu(static_x, static_logits)  # warm-up: backend selection, JIT compile of every variant
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gpu(static_x, static_logits)  # auto → masked during capture (24 tokens <= masked_max_tokens)
    for seed, hot in ((103, 0.0), (104, 6.0)):
        static_x.copy_(randn((t, 256), seed=seed, device="cuda"))
        new_logits = randn((t, 16), seed=seed + 1, device="cuda", dtype=torch.float32)
        new_logits[:, 3] += hot  # a hot expert
        static_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, gpu(static_x, static_logits, path="masked"))
    # the contiguous path captures too (no host sync): each replay's layout follows its own routing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gpu(static_x, static_logits, path="contiguous")
    for seed, hot in ((105, 0.0), (106, 9.0)):
        static_x.copy_(randn((t, 256), seed=seed, device="cuda"))
        new_logits = randn((t, 16), seed=seed + 1, device="cuda", dtype=torch.float32)
        new_logits[:, 5] += hot
        static_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, gpu(static_x, static_logits, path="contiguous"))


@pytest.mark.hopper
@pytest.mark.parametrize("ue8m0", [False, True])
def test_shared_experts_on_a_side_stream_give_the_inline_result(ue8m0):
    """On the masked path the shared experts run on a side stream beside routing and the routed experts
    (``shared_overlap``): bit-identical to running them in line, eagerly and replayed from a CUDA graph with new
    inputs, from 1 token up."""
    wts = MoEWeights(16, 256, 128, shared_inter=128, seed=120)
    wts = ue8m0_weights(wts) if ue8m0 else wts
    moe = wts.fill(Fp8FusedMoE(16, 256, 128, 4, num_shared_experts=1, ue8m0=ue8m0,
                               **ROUTINGS["grouped_sigmoid"])).cuda()
    assert moe.shared_overlap

    def inline(x, logits):
        moe.shared_overlap = False
        try:
            return moe(x, logits, path="masked")
        finally:
            moe.shared_overlap = True
    for t in (1, 3, 24):
        x, logits = (randn((t, 256), seed=121 + t, device="cuda"),
                     randn((t, 16), seed=122 + t, device="cuda", dtype=torch.float32))
        out = moe(x, logits, path="masked")
        assert out.isfinite().all() and torch.equal(out, inline(x, logits))
        assert calc_diff(out.cpu(), moe_loop_reference(x.cpu(), logits.cpu(), wts, 4, ROUTINGS["grouped_sigmoid"])) \
            < LAYER_DIFF
    static_x, static_logits = x.clone(), logits.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x, static_logits, path="masked")
    for seed in (130, 131):
        static_x.copy_(randn((t, 256), seed=seed, device="cuda"))
        static_logits.copy_(randn((t, 16), seed=seed + 1, device="cuda", dtype=torch.float32))
        static_out.fill_(float("nan"))  # poisoned: the replay must write every row
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, inline(static_x, static_logits))


# ----------------------------------------------------------------------------------------------
# UE8M0 (DeepSeek-V3.1: power-of-two scales)
# ----------------------------------------------------------------------------------------------
def test_check_weight_scales():
    layers.check_weight_scales(torch.tensor([[0.5, 0.0], [2.0 ** -30, 3.0]]), "s")
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=r"s: weight scales must be finite and >= 0, but 1 of 4 are not .*s\[1, 0\]"):
            layers.check_weight_scales(torch.tensor([[0.5, 1.0], [bad, 3.0]]), "s")
    with pytest.raises(TypeError, match=r"s: weight scales must be a floating-point tensor, got torch\.int32"):
        layers.check_weight_scales(torch.ones(2, 2, dtype=torch.int32), "s")
    with pytest.raises(TypeError, match="got list"):
        layers.check_weight_scales([0.5], "s")
    with pytest.raises(ValueError, match="scale_fmt 'ue8m0'"):  # and, with ue8m0, powers of two
        layers.check_weight_scales(torch.tensor([0.75]), "s", ue8m0=True)


def test_check_ue8m0_scales():
    layers.check_ue8m0_scales(torch.tensor([1.0, 2.0 ** -20, 0.5, 2.0 ** 30]), "s")
    for bad in (3.0, 0.0, -2.0, float("inf"), float("nan"), 0.75):
        with pytest.raises(ValueError, match=r"s: scale_fmt 'ue8m0' needs positive power-of-two scales.*s\[1\]"):
            layers.check_ue8m0_scales(torch.tensor([1.0, bad]), "s")


def test_ue8m0_linear_and_mlp():
    lin = torch.nn.Linear(256, 384, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(randn((384, 256), seed=1) * 0.06)
    fp8 = Fp8Linear.from_float(lin, ue8m0=True)
    assert fp8.ue8m0 and "ue8m0=True" in repr(fp8)
    layers.check_ue8m0_scales(fp8.weight_scale_inv, "weight_scale_inv")  # quantized with power-of-two scales
    x = randn((9, 256), seed=2)
    x_fp8, x_scale = quant.per_token_group(x, ue8m0=True)
    expected = ref.fp8_gemm(x_fp8, x_scale, fp8.weight, fp8.weight_scale_inv) + lin.bias
    assert torch.equal(fp8(x), expected)  # activations quantized with power-of-two scales
    w, s = _fp8_weight((384, 256), seed=3)  # plain fp32 scales
    with pytest.raises(ValueError, match="power-of-two"):
        Fp8Linear.from_fp8(w, s, ue8m0=True)
    with pytest.raises(ValueError, match="ue8m0 must be a bool"):
        Fp8Linear(256, 384, ue8m0=1)
    mlp = Fp8MLP(256, 128, ue8m0=True)
    assert mlp.gate_up_proj.ue8m0 and mlp.down_proj.ue8m0


def test_ue8m0_fused_moe_quantizes_both_activations_with_power_of_two_scales(monkeypatch):
    from moe_fp8.layers import linear as linear_module

    num_experts, hidden, inter, top_k, t = 8, 256, 128, 3, 13
    wts = ue8m0_weights(MoEWeights(num_experts, hidden, inter, shared_inter=128, seed=110))
    kwargs = dict(num_shared_experts=1, **ROUTINGS["grouped_sigmoid"])
    moe = wts.fill(Fp8FusedMoE(num_experts, hidden, inter, top_k, ue8m0=True, **kwargs))
    plain = wts.fill(Fp8FusedMoE(num_experts, hidden, inter, top_k, **kwargs))
    assert moe.shared_experts.ue8m0
    x, logits = randn((t, hidden), seed=111), randn((t, num_experts), seed=112, dtype=torch.float32)
    flags = []
    for module in (moe_module, linear_module):
        for name in ("per_token_group", "quant_dispatch_contiguous", "quant_dispatch_masked",
                     "silu_mul_per_token_group"):
            real = getattr(module, name, None)
            if real is None:  # linear has no dispatch
                continue

            def spy(*args, _real=real, **kw):
                flags.append(kw.get("ue8m0"))
                res = _real(*args, **kw)
                scale = res[1]  # the activation scales (the input's, for the fused quant + dispatch)
                if kw.get("ue8m0"):  # (the plain layer below calls these too)
                    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
                return res

            monkeypatch.setattr(module, name, spy)
    outs = {p: moe(x, logits, path=p) for p in ("contiguous", "masked")}
    # per path: the input (inside quant_dispatch_contiguous / _masked), the shared expert's and the routed
    # experts' SiLU·mul
    assert flags == [True] * 6
    assert torch.equal(outs["contiguous"], outs["masked"])
    assert calc_diff(outs["contiguous"], moe_loop_reference(x, logits, wts, top_k, ROUTINGS["grouped_sigmoid"])) \
        < LAYER_DIFF
    assert not torch.equal(outs["contiguous"], plain(x, logits))  # the scales really differ
