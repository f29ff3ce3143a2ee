"""Precompile every GEMM kernel variant a model needs, its router's Hopper routing kernels
(``routing_variants``) and router-logits kernels (``router_gemm_variants``), its activations' quantization
kernel (``quant_variants``) and its prefill dispatches' routing kernels (``dispatch_variants``), into the JIT disk
cache
(``moe-fp8 warmup``).

A variant bakes N, K and the tile configuration (STYLE practice 4); M and the grouped counts are
run-time values. So the variants of a model are: for each weight shape (after the tensor- and
expert-parallel split) and each layout it is multiplied in, the distinct configurations that
``heuristics.get_config`` picks over every token count the engine can send, turned into the exact
``(name, source)`` pairs ``kernels.gemm.kernel_variant`` gives ``build``. Nothing here needs a GPU:
NVRTC and nvcc compile sm_90a code on any machine, so a model's kernels can be built ahead of time
(in a container image build, on a CPU node) and loaded at serving time from the cache.

Weights enumerated from ``config.json`` (DeepSeek-V2/V3 keys; standard attention as a fallback):

====================  ==============================================  ======================
weight                N × K per rank                                  layouts
====================  ==============================================  ======================
q_a + kv_a (fused)    (q_lora + kv_lora + rope) × H, replicated       normal
q_b_proj / q_proj     heads/tp·(nope + rope) × q_lora (or H)          normal
kv_b_proj             heads/tp·(nope + v) × kv_lora                   normal
o_proj                H × heads/tp·v                                  normal
dense MLP             gate_up 2·I/tp × H, down H × I/tp               normal (first_k_dense_replace layers)
shared experts        gate_up 2·S/tp × H, down H × S/tp               normal (S = n_shared · moe_I)
routed experts        w13 2·moe_I/tp × H, w2 H × moe_I/tp, E/ep each  contiguous, masked
lm_head               vocab × H                                       normal, only if FP8 in the checkpoint
====================  ==============================================  ======================

Gate and up projections (and q_a / kv_a) are taken fused, as vLLM, SGLang and ``Fp8FusedMoE`` hold
them. Token counts: ``normal`` M = 1..max_tokens; ``masked`` expected M per expert = 1..max_tokens
(``num_groups`` = local experts); ``contiguous`` M_total = every multiple of 128 up to
``align(max_tokens·top_k, 128) + 128·local experts`` (each expert's segment is padded to 128 rows).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_fp8.kernels.heuristics import (
    CONTIGUOUS_ONE_BLOCK_MAX_ROWS,
    GemmConfig,
    GemmDesc,
    Layout,
    get_config,
    representative_rows,
)
from moe_fp8.kernels.tuning import MASKED_FINE_ROWS, MASKED_KEY_ROWS, TunedTable, warmup_tables
from moe_fp8.utils import ALIGN_M, GROUP_K, align

__all__ = [
    "DispatchVariant",
    "GemmShape",
    "ModelConfigError",
    "QuantVariant",
    "RouterGemmVariant",
    "RoutingVariant",
    "Variant",
    "WarmupResult",
    "compile_variants",
    "describe_rows",
    "dispatch_variants",
    "enumerate_variants",
    "fp8_lm_head_in_checkpoint",
    "load_model_config",
    "model_gemms",
    "quant_variants",
    "router_gemm_variants",
    "routing_variants",
    "shape_descs",
    "warmup",
    "warmup_tables",
]

# The GEMM kernels' own alignment rules (moe_fp8.validation): N rows of 16-byte bf16 output, K of
# 16-byte FP8 rows. A weight whose shard breaks them cannot run on the kernels at all.
N_ALIGN = 8
K_ALIGN = 16


class ModelConfigError(ValueError):
    """``config.json`` is missing, lacks a key, or gives shapes the kernels cannot run (message says which)."""


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One weight of the model as one rank multiplies by it: ``N × K``, ``num_groups`` experts."""

    name: str
    n: int
    k: int
    layouts: tuple[Layout, ...] = ("normal",)
    num_groups: int = 1
    act_quant: int = 0  # the experts' w13 on Hopper: GEMM1 with the SiLU·mul + quant epilogue (2: UE8M0)
    beside_few_rows: bool = False  # the shared experts: the few-rows rule of GEMMs next to the routed ones


@dataclasses.dataclass
class Variant:
    """One compiled kernel: its cache ``name`` and generated ``source``, and what needs it."""

    name: str
    source: str
    layout: Layout
    n: int
    k: int
    config: GemmConfig | None  # None: the few-rows GEMM (kernels/few_rows.py)
    users: list[str] = dataclasses.field(default_factory=list)  # weight names
    rows: tuple[int, int] = (0, 0)  # smallest and largest row count (see describe_rows) that picks it


@dataclasses.dataclass
class WarmupResult:
    """What ``compile_variants`` did: counts, times and the failures (name, message)."""

    variants: int = 0
    cached: int = 0
    compiled: int = 0
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0
    compile_seconds: float = 0.0  # summed over worker processes
    jobs: int = 0  # worker processes started (0: everything was cached)


# --------------------------------------------------------------------------------------------
# config.json → weight shapes
# --------------------------------------------------------------------------------------------

def load_model_config(model: Path) -> dict[str, Any]:
    """``model/config.json`` (``model`` may also be the file itself)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path} not found: --model must be a Hugging Face model directory "
                               f"(with config.json) or a config.json file") from None
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    # Multimodal wrappers keep the language model's keys in a sub-config.
    return cfg.get("text_config") or cfg


def _get(cfg: dict[str, Any], *keys: str, default: Any = ...) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is ...:
        raise ModelConfigError(f"config.json has no {' / '.join(keys)} (needed to derive the GEMM shapes)")
    return default


def _split(what: str, size: int, parts: int, flag: str) -> int:
    if size % parts:
        raise ModelConfigError(f"{what} = {size} does not split over {flag} {parts}; choose a {flag} that divides it")
    return size // parts


def fp8_lm_head_in_checkpoint(model_dir: Path | None) -> bool:
    """True when the checkpoint stores lm_head in FP8 (DeepSeek's own checkpoints keep it bf16)."""
    if model_dir is None or not model_dir.is_dir():
        return False
    index = model_dir / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError):
        return False
    return "lm_head.weight_scale_inv" in weight_map


def model_gemms(cfg: dict[str, Any], tp: int = 1, ep: int = 1, fp8_lm_head: bool = False) -> list[GemmShape]:
    """Every FP8 GEMM weight of one rank (see the module docstring), deduplicated by shape and layout.

    Raises ``ModelConfigError`` for missing keys, a block size other than 128×128, a split that does
    not divide, or a shard the kernels cannot run (N % 8, K % 16; expert shards of I must stay
    multiples of 128, DESIGN §5).
    """
    if tp < 1 or ep < 1:
        raise ModelConfigError(f"--tp and --ep must be >= 1, got tp={tp} ep={ep}")
    block = (cfg.get("quantization_config") or {}).get("weight_block_size")
    if block is not None and list(block) != [GROUP_K, GROUP_K]:
        raise ModelConfigError(f"quantization_config.weight_block_size is {block}; moe_fp8 kernels take "
                               f"[{GROUP_K}, {GROUP_K}] blocks only")
    h = _get(cfg, "hidden_size")
    heads = _get(cfg, "num_attention_heads")
    heads_tp = _split("num_attention_heads", heads, tp, "--tp")
    out: list[GemmShape] = []

    if cfg.get("kv_lora_rank") is not None:  # MLA (DeepSeek-V2/V3, Kimi-K2)
        kv_lora = cfg["kv_lora_rank"]
        rope, nope = _get(cfg, "qk_rope_head_dim"), _get(cfg, "qk_nope_head_dim")
        v_dim = _get(cfg, "v_head_dim")
        q_lora = cfg.get("q_lora_rank")
        if q_lora:
            out.append(GemmShape("q_a_proj+kv_a_proj_with_mqa", q_lora + kv_lora + rope, h))
            out.append(GemmShape("q_b_proj", heads_tp * (nope + rope), q_lora))
        else:  # DeepSeek-V2-Lite: no query compression
            out.append(GemmShape("q_proj", heads_tp * (nope + rope), h))
            out.append(GemmShape("kv_a_proj_with_mqa", kv_lora + rope, h))
        out.append(GemmShape("kv_b_proj", heads_tp * (nope + v_dim), kv_lora))
        out.append(GemmShape("o_proj", h, heads_tp * v_dim))
    else:  # standard multi-head / grouped-query attention, q, k, v fused
        head_dim = cfg.get("head_dim") or h // heads
        kv_heads = _get(cfg, "num_key_value_heads", default=heads)
        kv_heads_tp = max(1, kv_heads // tp)  # fewer KV heads than ranks: replicated
        out.append(GemmShape("qkv_proj", (heads_tp + 2 * kv_heads_tp) * head_dim, h))
        out.append(GemmShape("o_proj", h, heads_tp * head_dim))

    n_experts = _get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    first_dense = cfg.get("first_k_dense_replace", 0 if n_experts else 1 << 30)
    n_layers = cfg.get("num_hidden_layers", 1 << 30)
    # dense layers among the MoE ones: DeepSeek's moe_layer_freq, Qwen-MoE's mlp_only_layers / decoder_sparse_step
    sparse_step = max(int(cfg.get("moe_layer_freq") or 1), int(cfg.get("decoder_sparse_step") or 1))
    if not n_experts or first_dense > 0 or cfg.get("mlp_only_layers") or sparse_step > 1:
        inter = _split("intermediate_size", _get(cfg, "intermediate_size"), tp, "--tp")
        out.append(GemmShape("mlp.gate_up_proj", 2 * inter, h))
        out.append(GemmShape("mlp.down_proj", h, inter))
    if n_experts and first_dense < n_layers:
        moe_inter = _get(cfg, "moe_intermediate_size", "intermediate_size")
        shared = (cfg.get("shared_expert_intermediate_size")
                  or (cfg.get("n_shared_experts") or 0) * moe_inter)
        if shared:
            s_tp = _split("shared experts' intermediate size", shared, tp, "--tp")
            out.append(GemmShape("shared_experts.gate_up_proj", 2 * s_tp, h, beside_few_rows=True))
            out.append(GemmShape("shared_experts.down_proj", h, s_tp, beside_few_rows=True))
        i_tp = _split("moe_intermediate_size", moe_inter, tp, "--tp")
        if i_tp % GROUP_K:
            if tp == 1:  # no smaller --tp to suggest: the model itself is outside what the MoE layer runs
                raise ModelConfigError(f"moe_intermediate_size = {moe_inter} is not a multiple of {GROUP_K}: "
                                       f"Fp8FusedMoE (fused gate/up, {GROUP_K}-wide scale blocks) cannot run this "
                                       f"model's experts")
            raise ModelConfigError(f"moe_intermediate_size/tp = {moe_inter}/{tp} = {i_tp} is not a multiple of "
                                   f"{GROUP_K} (expert weight-scale blocks would straddle ranks); use a smaller --tp")
        local = _split("the routed expert count", n_experts, ep, "--ep")
        _get(cfg, "num_experts_per_tok")  # needed for the contiguous row bound; fail early if absent
        # Fp8FusedMoE runs GEMM1 with SiLU·mul + quant in its epilogue where 2I is a multiple of 256
        ue8m0 = (cfg.get("quantization_config") or {}).get("scale_fmt") == "ue8m0"
        act_quant = (2 if ue8m0 else 1) if (2 * i_tp) % 256 == 0 else 0
        out.append(GemmShape("experts.w13", 2 * i_tp, h, ("contiguous", "masked"), local, act_quant))
        out.append(GemmShape("experts.w2", h, i_tp, ("contiguous", "masked"), local))
    if fp8_lm_head:
        out.append(GemmShape("lm_head", _split("vocab_size", _get(cfg, "vocab_size"), tp, "--tp"), h))

    for g in out:
        if g.n % N_ALIGN or g.k % K_ALIGN or g.n <= 0 or g.k <= 0:
            raise ModelConfigError(f"{g.name}: shard {g.n}×{g.k} (N×K) is not supported by the kernels "
                                   f"(N must be a multiple of {N_ALIGN}, K of {K_ALIGN}); try another --tp")
    unique: dict[tuple, GemmShape] = {}
    for g in out:  # e.g. shared experts and the dense MLP can coincide
        key = (g.n, g.k, g.layouts, g.num_groups, g.act_quant)
        if key in unique:  # the wider few-rows rule of either: its variants include the other's
            first = unique[key]
            unique[key] = dataclasses.replace(first, name=f"{first.name}, {g.name}",
                                              beside_few_rows=first.beside_few_rows or g.beside_few_rows)
        else:
            unique[key] = g
    return list(unique.values())


# --------------------------------------------------------------------------------------------
# weight shapes → distinct kernel variants
# --------------------------------------------------------------------------------------------

def _row_classes(max_rows: int, bounds: range = range(0)) -> list[tuple[int, int]]:
    """``(first, last)`` row counts of each interval that shares one config (see representative_rows), split at
    ``bounds`` as well."""
    reps = sorted({*representative_rows(max_rows), *(b for b in bounds if b < max_rows)})
    return list(zip([1] + [r + 1 for r in reps[:-1]], reps, strict=True))


def shape_descs(g: GemmShape, max_tokens: int, top_k: int, num_sms: int) -> list[tuple[Layout, int, int, GemmDesc]]:
    """``(layout, first, last, desc)``: one descriptor per class of row counts of every layout of ``g``."""
    out: list[tuple[Layout, int, int, GemmDesc]] = []
    for layout in g.layouts:
        if layout == "normal":
            out += [(layout, lo, hi, GemmDesc(hi, g.n, g.k, num_sms=num_sms)) for lo, hi in _row_classes(max_tokens)]
        elif layout == "masked":
            # the config depends on expected_m (the per-expert count hint), which is at most max_tokens; a tuned
            # table's keys split its classes finer at decode sizes (tuning.tuning_key)
            fine = range(MASKED_KEY_ROWS, MASKED_FINE_ROWS + 1, MASKED_KEY_ROWS)
            out += [(layout, lo, hi, GemmDesc(max_tokens, g.n, g.k, g.num_groups, "masked", num_sms, expected_m=hi,
                                              act_quant=g.act_quant))
                    for lo, hi in _row_classes(max_tokens, fine)]
        else:
            # M_total = Σ_e align(count_e, 128): a multiple of 128, at most every routed row plus a
            # padding segment per local expert; each value is enumerated (a few hundred at most), under each
            # class of the layer's expected rows per expert (none, about one block: see config_key)
            upper = min(align(max_tokens * top_k, ALIGN_M) + ALIGN_M * g.num_groups,
                        g.num_groups * align(max_tokens, ALIGN_M))
            out += [(layout, m, m, GemmDesc(m, g.n, g.k, g.num_groups, "contiguous", num_sms, expected_m=hint,
                                            act_quant=g.act_quant))
                    for m in range(ALIGN_M, upper + 1, ALIGN_M)
                    for hint in (None, CONTIGUOUS_ONE_BLOCK_MAX_ROWS)]
    return out


def enumerate_variants(gemms: list[GemmShape], max_tokens: int, num_sms: int, top_k: int = 8,
                       tables: list[TunedTable] | None = None) -> list[Variant]:
    """Distinct ``(name, source)`` pairs over all weights, layouts and token counts, in first-use order: what
    ``get_config`` picks, and what each of ``tables`` (default ``tuning.warmup_tables(num_sms)``) holds for the
    same calls."""
    from moe_fp8.kernels.gemm import kernel_variant

    if max_tokens < 1:
        raise ModelConfigError(f"--max-tokens must be >= 1, got {max_tokens}")
    tables = warmup_tables(num_sms) if tables is None else tables
    found: dict[str, Variant] = {}

    def add(g: GemmShape, name: str, source: str, layout: Layout, cfg: GemmConfig | None, lo: int, hi: int) -> None:
        v = found.get(name)
        if v is None:
            v = found[name] = Variant(name, source, layout, g.n, g.k, cfg, rows=(lo, hi))
        elif v.source != source:  # the name encodes every baked field; a clash is a bug there
            raise AssertionError(f"two sources for kernel name {name}")
        if g.name not in v.users:
            v.users.append(g.name)
        v.rows = (min(v.rows[0], lo), max(v.rows[1], hi))

    for g in gemms:
        for layout, lo, hi, desc in shape_descs(g, max_tokens, top_k, num_sms):
            configs = [get_config(desc), *(t.get(desc) for t in tables)]
            for cfg in dict.fromkeys(c for c in configs if c is not None):
                add(g, *kernel_variant(desc, cfg), layout, cfg, lo, hi)
    for g in gemms:
        for layout, lo, hi, name, source in _few_rows_variants(g, max_tokens, num_sms):
            add(g, name, source, layout, None, lo, hi)
    return list(found.values())


def _few_rows_variants(g: GemmShape, max_tokens: int, num_sms: int) -> list[tuple[Layout, int, int, str, str]]:
    """``(layout, first, last, name, source)``: the few-rows GEMM of each token tile that decode batches of
    ``first..last`` tokens run (kernels/few_rows.py): normal GEMMs (up to 8 or 16 rows at long K, the shared
    experts' up to 16 at any K, and in chunks past that for small weights), masked ones (FP32 out under the fused
    GEMM1's SiLU·mul + quant), chunked past 16 rows for small groups (the batches whose expected rows per expert are
    few take it)."""
    from moe_fp8.kernels import few_rows

    out: list[tuple[Layout, int, int, str, str]] = []
    if "normal" in g.layouts:  # one variant per token tile count (1: 1-8 rows, 2: 9-16), then the chunked one
        for lo, hi in ((1, 8), (9, few_rows.MAX_ROWS), (few_rows.MAX_ROWS + 1, few_rows.NORMAL_CHUNKED_MAX_ROWS)):
            hi = min(hi, max_tokens)
            if lo <= hi and few_rows.applies_normal(hi, g.n, g.k, beside=g.beside_few_rows, num_sms=num_sms):
                out.append(("normal", lo, hi, *few_rows.kernel_variant(g.n, g.k, hi)))
    if "masked" in g.layouts:
        top = min(max_tokens, few_rows.max_rows(g.n, g.k))
        for lo in range(1, top + 1, 8):
            hi = min(lo + 7, top)
            if few_rows.applies(hi, g.n, g.k, g.num_groups, fused=bool(g.act_quant), num_sms=num_sms):
                # and at 9-16 rows the chunks that decode batches expected to hold one row an expert take
                variants = (few_rows.kernel_variant(g.n, g.k, hi, bool(g.act_quant), hint) for hint in (None, 1))
                out += [("masked", lo, hi, *v) for v in dict.fromkeys(variants)]
        # past that, small groups expected to hold few rows each (chunks: one variant for every max_m)
        if max_tokens > top and few_rows.applies(top + 1, g.n, g.k, g.num_groups, expected_m=1,
                                                 fused=bool(g.act_quant), num_sms=num_sms):
            out.append(("masked", top + 1, max_tokens,
                        *few_rows.kernel_variant(g.n, g.k, top + 1, out_f32=bool(g.act_quant))))
    return out


@dataclasses.dataclass
class RoutingVariant:
    """One compiled Hopper routing kernel (``kernels/routing.py``): its cache ``name``, ``source``, and the
    router-logits dtype it serves."""
    name: str
    source: str
    logits_dtype: str


def routing_variants(cfg: dict[str, Any]) -> list[RoutingVariant]:
    """The Hopper ``select_experts`` kernels of the model's router (over all routed experts, whatever the
    parallelism): float32 and bfloat16 logits (engines differ), with the float32 correction bias when
    ``topk_method`` is ``noaux_tc``. None where the CUDA kernel does not cover the router (softmax
    scoring, expert counts off its lane layout): the Triton kernel runs those."""
    import torch

    from moe_fp8.kernels.routing import kernel_variant, plan

    n_experts = _get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    bias = torch.float32 if cfg.get("topk_method") == "noaux_tc" else None
    out = []
    for logits in (torch.float32, torch.bfloat16):  # (plan: None for a dense model or an uncovered router)
        shape = plan(n_experts, top_k, cfg.get("scoring_func", "softmax"), cfg.get("n_group"),
                     cfg.get("topk_group"), logits, bias)
        if shape is not None:
            out.append(RoutingVariant(*kernel_variant(logits, bias, *shape), str(logits)[6:]))
    return out


@dataclasses.dataclass
class RouterGemmVariant:
    """One compiled Hopper router-logits kernel (``kernels/router_gemm.py``): its cache ``name``, ``source``, the
    router weight's dtype and the token tile it serves."""
    name: str
    source: str
    weight_dtype: str
    tokens: int


def router_gemm_variants(cfg: dict[str, Any], num_sms: int) -> list[RouterGemmVariant]:
    """The Hopper ``router_gemm`` kernels of the model's router (``[E, hidden]``, all routed experts): every token
    tile up to ``MAX_TOKENS`` (decode batches), for bf16 weights (engines) and float32 ones (the transformers
    integration keeps its router weight so). None for a dense model."""
    import torch

    from moe_fp8.kernels import router_gemm as rg

    n_experts = _get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    hidden = _get(cfg, "hidden_size", default=0)
    out = []
    for weight in (torch.bfloat16, torch.float32):
        for t in sorted({rg.token_tile(t) for t in range(1, rg.MAX_TOKENS + 1)}):
            shape = rg.plan(t, hidden, n_experts, weight, num_sms) if n_experts else None
            if shape is not None:
                out.append(RouterGemmVariant(*rg.kernel_variant(weight, *shape[:3]), str(weight)[6:], t))
    return out


@dataclasses.dataclass
class QuantVariant:
    """One compiled Hopper activation-quantization kernel (``kernels/quant.py``): its cache ``name``, ``source``,
    its scales' format and the layers that call it."""
    name: str
    source: str
    scales: str
    users: str


def quant_variants(cfg: dict[str, Any]) -> list[QuantVariant]:
    """The Hopper quantization kernels of the model's bf16 activations: ``per_token_group_quant`` (every Fp8Linear's
    input) and its SiLU·mul form (Fp8MLP's), with UE8M0 scales where the checkpoint's ``scale_fmt`` says so
    (DeepSeek-V3.1)."""
    import torch

    from moe_fp8.kernels import quant

    ue8m0 = (cfg.get("quantization_config") or {}).get("scale_fmt") == "ue8m0"
    scales = "ue8m0" if ue8m0 else "float32"
    return [QuantVariant(*quant.kernel_variant(torch.bfloat16, ue8m0), scales, "Fp8Linear inputs"),
            QuantVariant(*quant.kernel_variant(torch.bfloat16, ue8m0, silu=True), scales, "Fp8MLP SiLU·mul")]


@dataclasses.dataclass
class DispatchVariant:
    """One compiled Hopper routing kernel of the chunked dispatches (``kernels/dispatch.py``: ``route_pairs``): its
    cache ``name``, ``source`` and the dispatch layout it serves."""
    name: str
    source: str
    layout: str


def dispatch_variants(cfg: dict[str, Any], ep: int = 1) -> list[DispatchVariant]:
    """The ``route_pairs`` kernels of the MoE layer's prefill dispatches on one rank: int32 ids (what
    ``select_experts`` returns), under the layer's int32 expert map where ``ep > 1``, for the contiguous and the
    masked layout. None for a dense model or more local experts than the kernel takes (the Triton kernels)."""
    import torch

    from moe_fp8.kernels.dispatch import ROUTE_MAX_EXPERTS, route_variant

    n_experts = _get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    local = n_experts // ep if n_experts and n_experts % ep == 0 else 0
    if not 1 <= local <= ROUTE_MAX_EXPERTS:
        return []
    emap = torch.int32 if ep > 1 else None
    return [DispatchVariant(*route_variant(torch.int32, emap, masked, local), "masked" if masked else "contiguous")
            for masked in (False, True)]


def describe_rows(v: Variant) -> str:
    """The row counts that select ``v``: M (normal), M_total (contiguous), expected M per expert (masked)."""
    what = "tokens" if v.config is None else {"normal": "M", "contiguous": "M_total", "masked": "expected M"}[v.layout]
    lo, hi = v.rows
    return f"{what} {lo}" if lo == hi else f"{what} {lo}..{hi}"


# --------------------------------------------------------------------------------------------
# compile in worker processes
# --------------------------------------------------------------------------------------------

def _compile_worker(name: str, source: str, compiler: str) -> tuple[str, float, str | None]:
    """Runs in a worker process: ``build`` into the disk cache. Returns (name, seconds, error or None).

    Errors come back as text: ``JitCompileError`` carries ``log`` and ``path`` as attributes that
    pickling would drop, and its message already names the saved source and log."""
    from moe_fp8.kernels.jit import build

    t0 = time.perf_counter()
    try:
        build(name, source, compiler=compiler)
    except Exception as e:
        return name, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return name, time.perf_counter() - t0, None


def compile_variants(variants: list[Variant | RoutingVariant | QuantVariant | RouterGemmVariant], jobs: int | None = None, compiler: str | None = None,
                     on_done: Callable[[str, str | None], None] | None = None,
                     on_cached: Callable[[int], None] | None = None) -> WarmupResult:
    """Compile the variants not yet in the disk cache, ``jobs`` at a time in separate processes.

    ``on_cached(n)`` is called once with the number of cache hits, ``on_done(name, error)`` after each
    compile. Raises ``CompilerNotFoundError`` before starting anything when no compiler is usable,
    ``JitCacheError`` when the cache directory is not writable.
    """
    from moe_fp8.kernels.jit import get_compiler, is_cached
    from moe_fp8.kernels.jit.cache import _lock_dir, cache_dir

    t_start = time.perf_counter()
    comp = get_compiler(compiler)
    result = WarmupResult(variants=len(variants))
    todo = [v for v in variants if not is_cached(v.name, v.source, compiler=comp)]
    result.cached = len(variants) - len(todo)
    if on_cached is not None:
        on_cached(result.cached)
    if todo:
        _lock_dir(cache_dir())  # an unwritable cache fails here, once, not in every worker
    if todo:
        jobs = result.jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
        # NOTE: spawn, not fork: the parent has torch (and its thread pools) loaded, and forking a
        # multi-threaded process can deadlock the child; a fresh interpreter costs ~1 s per worker.
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_compile_worker, v.name, v.source, comp.name) for v in todo]
            for fut in cf.as_completed(futures):
                name, seconds, error = fut.result()
                result.compile_seconds += seconds
                if error is None:
                    result.compiled += 1
                else:
                    result.failed.append((name, error))
                if on_done is not None:
                    on_done(name, error)
    result.wall_seconds = time.perf_counter() - t_start
    return result


def warmup(model: str | Path, tp: int = 1, ep: int = 1, max_tokens: int = 8192, jobs: int | None = None,
           num_sms: int | None = None, compiler: str | None = None) -> WarmupResult:
    """Python API of ``moe-fp8 warmup``: enumerate the model's variants (GEMMs, routing, quantization, dispatch
    routing) and compile
    the missing ones.

    ``num_sms`` defaults to ``moe_fp8.get_num_sms()`` (the visible GPU's, else ``$MOE_FP8_NUM_SMS``,
    else 132): it must be what the serving process will use, as it changes the chosen configs.
    """
    from moe_fp8.utils import get_num_sms

    cfg = load_model_config(Path(model))
    gemms = model_gemms(cfg, tp, ep, fp8_lm_head=fp8_lm_head_in_checkpoint(Path(model)))
    num_sms = num_sms or get_num_sms()
    variants = enumerate_variants(gemms, max_tokens, num_sms, top_k=int(cfg.get("num_experts_per_tok") or 1))
    return compile_variants([*variants, *routing_variants(cfg), *quant_variants(cfg), *dispatch_variants(cfg, ep),
                             *router_gemm_variants(cfg, num_sms)], jobs, compiler)

