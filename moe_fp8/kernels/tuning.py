"""Tuned GEMM configurations: measured on this GPU, consulted before the cost model.

The cost model (``heuristics``) is calibrated on one H100 SXM and still misses on a few shape families, by up to 44%
(docs/benchmarks/h100-tuning.md); other Hopper parts (H100 PCIe, H800, H20, H200) differ in SMs, clocks and bandwidth.
``moe-fp8 tune`` times ``heuristics.tuning_candidates`` of each GEMM a model runs and keeps the fastest where a
second, confirming round shows it beating ``default_config`` by ``MIN_GAIN`` (one round's minimum over several
noisy candidates is biased low). It writes one JSON table per device, which ``heuristics.get_config`` reads:

- ``$MOE_FP8_TUNED_CONFIGS``: that file alone (``0`` / ``off``: no table);
- else the current GPU's table shipped in the package (``moe_fp8/kernels/tuned/<device>.json``: picks measured on
  our H100 that two independent re-timings confirmed, see ``scripts/check_tuned.py``), overridden entry by entry by
  its table in the JIT cache (``<cache>/tuned/<device>.json``, ``moe-fp8 tune``'s default output), where they exist.

Entries are keyed by ``tuning_key``: the descriptor ``get_config`` decides on, so one entry covers the row counts
that share a configuration. A call without an entry takes the model's pick. Contiguous keys are timed on whole
layouts of their row count; the sync-free upper-bound layouts of ``Fp8FusedMoE`` under the one-block hint (more rows
than one block per group) are not tuned (``model_descs``). Every tuned configuration is a valid
launch for any row count (only speed depends on the key), and a table is checked when it is loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..utils import align, ceil_div
from .heuristics import (
    BLOCK_K,
    GemmConfig,
    GemmDesc,
    config_key,
    default_config,
    get_config,
    make_config,
    tuning_candidates,
)

__all__ = [
    "ENV_TABLE",
    "TuneError",
    "TuneResult",
    "TunedTable",
    "TunedTableError",
    "active_table",
    "default_path",
    "describe_active",
    "device_file_name",
    "lookup",
    "make_runner",
    "model_descs",
    "new_table",
    "packaged_path",
    "plan",
    "reset",
    "time_configs",
    "tune",
    "tune_key",
    "tuning_key",
    "warmup_tables",
]

ENV_TABLE = "MOE_FP8_TUNED_CONFIGS"
FORMAT = 1
MIN_GAIN = 0.02  # a tuned pick must beat the default by this much in the confirming round
# masked keys: expected rows per group rounded up to this below MASKED_FINE_ROWS (decode sizes, where the measured
# decode tiles change at 48 and 96 rows), to config_key's 64 above
MASKED_KEY_ROWS = 16
MASKED_FINE_ROWS = 128
_DESC_FIELDS = ("layout", "m", "n", "k", "num_groups", "num_sms", "expected_m", "act_quant")
_CONFIG_FIELDS = ("block_m", "block_n", "num_stages", "swizzle_group_m", "multicast", "multicast_on_a", "split_k",
                  "tail_split", "k_split", "a_box_rows")


class TuneError(RuntimeError):
    """Tuning cannot run here: no GPU, or a candidate kernel failed to compile (message says which)."""


class TunedTableError(ValueError):
    """A tuned-configuration table cannot be read or holds an entry the kernels cannot run (message says which)."""


def tuning_key(desc: GemmDesc) -> GemmDesc:
    """The descriptor a table entry is stored under: ``config_key``'s, but masked GEMMs by their expected rows
    alone (``max_m`` does not change the choice), in steps of ``MASKED_KEY_ROWS`` below ``MASKED_FINE_ROWS``."""
    key = config_key(desc)
    if desc.layout != "masked":
        return key
    rows = desc.expected_m or desc.m
    step = MASKED_KEY_ROWS if rows <= MASKED_FINE_ROWS else 64
    rows = step * ceil_div(rows, step)
    return dataclasses.replace(key, m=rows, expected_m=rows)


def device_file_name(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3.json' (the whole name: H100 SXM and PCIe differ)."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json"


PACKAGED_DIR = Path(__file__).resolve().parent / "tuned"


def packaged_path(device_name: str) -> Path:
    """The table of ``device_name`` shipped with moe_fp8 (may not exist)."""
    return PACKAGED_DIR / device_file_name(device_name)


def default_path(device_name: str) -> Path:
    """Where ``moe-fp8 tune`` writes, and ``get_config`` looks for, the table of ``device_name``."""
    from .jit.cache import cache_dir

    return cache_dir() / "tuned" / device_file_name(device_name)


# The header whose include closure a table's picks were measured on (``TunedTable.kernels``): the wgmma GEMM's
# sources only, so kernels that share no header with it (the few-rows GEMM, the data path) leave tables current.
GEMM_ENTRY_HEADER = "moe_fp8/impls/fp8_gemm.cuh"


def _kernel_sources_hash() -> str:
    from .jit.cache import include_closure_hash

    return include_closure_hash(GEMM_ENTRY_HEADER)


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """One key's measurement: the configuration kept (``config``), the default, and their times (µs)."""

    key: GemmDesc
    config: GemmConfig
    default: GemmConfig
    us: float
    default_us: float
    candidates: int = 0

    @property
    def gain(self) -> float:
        """The default's time over the kept configuration's, minus one (0 where the default was kept)."""
        return self.default_us / self.us - 1.0

    def to_json(self) -> dict[str, Any]:
        return {"key": {f: getattr(self.key, f) for f in _DESC_FIELDS},
                "config": _config_json(self.config), "default": _config_json(self.default),
                "us": round(self.us, 3), "default_us": round(self.default_us, 3), "candidates": self.candidates}


def _config_json(cfg: GemmConfig) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in _CONFIG_FIELDS}


def _parse_config(key: GemmDesc, data: Any, where: str) -> GemmConfig:
    """A stored configuration, rebuilt through ``make_config`` (and checked against the layout the way a launch
    checks it), so a hand-edited or stale entry fails here, not in a kernel."""
    from .gemm import generate_source

    if not isinstance(data, dict) or set(data) != set(_CONFIG_FIELDS):
        raise TunedTableError(f"{where}: a configuration needs exactly the fields {', '.join(_CONFIG_FIELDS)}")
    try:
        cfg = make_config(data["block_m"], data["block_n"], key.num_sms, k=key.k, num_stages=data["num_stages"],
                          multicast=data["multicast"], multicast_on_a=data["multicast_on_a"], split_k=data["split_k"],
                          swizzle_group_m=data["swizzle_group_m"], tail_split=data["tail_split"],
                          k_split=data["k_split"], a_box_rows=data["a_box_rows"])
        generate_source(key.layout, key.n, key.k, cfg, key.act_quant)
    except (TypeError, ValueError) as e:
        raise TunedTableError(f"{where}: {e}") from None
    return cfg


def _parse_key(data: Any, where: str) -> GemmDesc:
    if not isinstance(data, dict) or set(data) != set(_DESC_FIELDS):
        raise TunedTableError(f"{where}: a key needs exactly the fields {', '.join(_DESC_FIELDS)}")
    if data["layout"] not in ("normal", "contiguous", "masked"):
        raise TunedTableError(f"{where}: unknown layout {data['layout']!r}")
    ints = [f for f in _DESC_FIELDS if f not in ("layout", "expected_m")]
    if any(not isinstance(data[f], int) or data[f] < 0 for f in ints) or not (
            data["expected_m"] is None or isinstance(data["expected_m"], int)):
        raise TunedTableError(f"{where}: key fields must be non-negative integers: {data}")
    desc = GemmDesc(**data)
    if tuning_key(desc) != desc:
        raise TunedTableError(f"{where}: {desc} is not a tuning key (rows are stored rounded, see tuning_key)")
    return desc


@dataclasses.dataclass
class TunedTable:
    """Tuned configurations of one device, by ``tuning_key``."""

    device: str
    num_sms: int
    results: dict[GemmDesc, TuneResult] = dataclasses.field(default_factory=dict)
    kernels: str = ""  # include_tree_hash() of the kernel sources it was measured with
    version: str = ""  # moe_fp8's

    def get(self, desc: GemmDesc) -> GemmConfig | None:
        """The tuned configuration of ``desc``: where the measurement beat the default (else None: the model's)."""
        result = self.results.get(tuning_key(desc))
        return None if result is None or result.config == result.default else result.config

    def update(self, results: Iterable[TuneResult]) -> None:
        for r in results:
            self.results[r.key] = r

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "device": self.device, "num_sms": self.num_sms, "kernels": self.kernels,
                "moe_fp8": self.version, "results": [r.to_json() for r in self.results.values()]}

    def save(self, path: Path) -> None:
        """Write atomically (a reader never sees half a table)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        data = self.to_json()
        results = data.pop("results")
        head = json.dumps(data, indent=1)[:-2]  # one result a line: short, and diffs show which keys moved
        tmp.write_text(head + ',\n "results": [\n' + ",\n".join(f"  {json.dumps(r)}" for r in results) + "\n ]\n}\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> TunedTable:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise TunedTableError(f"{path}: no such file (moe-fp8 tune writes it)") from None
        except (OSError, ValueError) as e:
            raise TunedTableError(f"{path}: cannot read a JSON table: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TunedTableError(f"{path}: not a moe_fp8 tuned table of format {FORMAT} "
                                  f"(found {data.get('format') if isinstance(data, dict) else type(data).__name__})")
        if not isinstance(data.get("device"), str) or not isinstance(data.get("num_sms"), int):
            raise TunedTableError(f"{path}: needs 'device' (a name) and 'num_sms' (an int)")
        table = cls(data["device"], data["num_sms"], kernels=str(data.get("kernels", "")),
                    version=str(data.get("moe_fp8", "")))
        for i, item in enumerate(data.get("results", [])):
            where = f"{path}: results[{i}]"
            if not isinstance(item, dict):
                raise TunedTableError(f"{where}: not an object")
            key = _parse_key(item.get("key"), where)
            if key.num_sms != table.num_sms:
                raise TunedTableError(f"{where}: num_sms {key.num_sms} in a table of {table.num_sms} SMs")
            try:
                us, default_us = float(item["us"]), float(item["default_us"])
            except (KeyError, TypeError, ValueError):
                raise TunedTableError(f"{where}: needs the times 'us' and 'default_us'") from None
            table.results[key] = TuneResult(key, _parse_config(key, item.get("config"), where),
                                            _parse_config(key, item.get("default"), where), us, default_us,
                                            int(item.get("candidates", 0)))
        return table


def _current_device_name() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


@functools.cache
def active_table() -> TunedTable | None:
    """The table ``get_config`` consults (read once per process; ``reset`` re-reads; see the module docstring).
    A table named by ``$MOE_FP8_TUNED_CONFIGS`` but measured on another device is ignored, with a warning. One
    measured on other kernel sources is used (its configurations still run), with a warning; the shipped table is
    not checked (it is re-measured with the kernels it ships with)."""
    spec = os.environ.get(ENV_TABLE)
    device = _current_device_name()
    if spec is not None:
        if spec.strip().lower() in ("", "0", "off", "none"):
            return None
        table = own = TunedTable.load(Path(spec).expanduser())
        if device is not None and table.device != device:
            warnings.warn(f"moe_fp8: the tuned table {spec} was measured on {table.device}, this is {device}: "
                          f"not used", stacklevel=2)
            return None
    elif device is None:
        return None
    else:
        packaged, own = (TunedTable.load(p) if p.exists() else None
                         for p in (packaged_path(device), default_path(device)))
        if own is not None and own.device != device:
            raise TunedTableError(f"{default_path(device)} holds {own.device}'s table, this is {device}")
        table = packaged or own
        if table is None:
            return None
        if packaged is not None and own is not None:
            table.update(own.results.values())
    if own is not None and own.kernels and own.kernels != _kernel_sources_hash():
        warnings.warn("moe_fp8: the tuned table was measured with other kernel sources (an older or newer moe_fp8): "
                      "its configurations still run, but re-run `moe-fp8 tune` for picks measured on these",
                      stacklevel=2)
    return table


def describe_active() -> str:
    """Which tables ``get_config`` reads here, for ``moe-fp8 info`` (reads the files, never raises)."""
    spec = os.environ.get(ENV_TABLE)
    if spec is not None and spec.strip().lower() in ("", "0", "off", "none"):
        return f"off (${ENV_TABLE}={spec})"
    try:
        device = _current_device_name()
        paths = [Path(spec).expanduser()] if spec is not None else (
            [] if device is None else [packaged_path(device), default_path(device)])
        found = []
        for path in paths:
            if path.exists():
                table = TunedTable.load(path)
                found.append(f"{path} ({sum(r.config != r.default for r in table.results.values())} picks)")
        return " + ".join(found) or ("no GPU visible" if device is None and spec is None else "none for this GPU")
    except Exception as e:
        return f"unreadable: {type(e).__name__}: {e}"


def warmup_tables(num_sms: int) -> list[TunedTable]:
    """Tables whose picks ``moe-fp8 warmup`` compiles besides ``get_config``'s: where no GPU is visible and
    ``$MOE_FP8_TUNED_CONFIGS`` names no table, every shipped table of ``num_sms`` SMs (the GPU that will serve is
    not known here, and its shipped picks would otherwise compile at their first call). Elsewhere none:
    ``get_config`` already takes the tables that apply."""
    if os.environ.get(ENV_TABLE) is not None or _current_device_name() is not None:
        return []
    tables = (TunedTable.load(path) for path in sorted(PACKAGED_DIR.glob("*.json")))
    return [t for t in tables if t.num_sms == num_sms]


def lookup(desc: GemmDesc) -> GemmConfig | None:
    """The active table's configuration of ``desc``, or None."""
    table = active_table()
    return None if table is None else table.get(desc)


def reset() -> None:
    """Forget the active table and every configuration picked from it (after writing or switching tables)."""
    from .gemm import _PREPARED

    active_table.cache_clear()
    get_config.cache_clear()
    _PREPARED.clear()


# --------------------------------------------------------------------------------------------
# measuring (GPU)
# --------------------------------------------------------------------------------------------

FLUSH_BYTES = 256 << 20  # zeroed before every timed call (L2 is 50 MB), as triton.testing.do_bench does


def _contiguous_sizes(key: GemmDesc) -> list[int]:
    """Rows per group whose 128-aligned segments fill ``key.m`` rows: blocks spread evenly over the groups
    (groups past the block count empty), a group holding a seeded 70-100% of its last block; under the one-block
    hint (``key.expected_m``) one block per group of up to 64 rows."""
    blocks = align(key.m, 128) // 128
    if key.expected_m is not None and blocks > key.num_groups:
        raise ValueError(f"{key}: {blocks} blocks of rows cannot be groups of one block each")
    rng = random.Random(key.m * 7919 + key.num_groups)
    last_rows = key.expected_m or 128
    sizes = []
    for g in range(key.num_groups):
        b = blocks // key.num_groups + (g < blocks % key.num_groups)
        sizes.append(0 if b == 0 else (b - 1) * 128 + math.ceil(last_rows * rng.uniform(0.7, 1.0)))
    return sizes


def _masked_max_m(expected: int) -> int:
    return align(math.ceil(expected * 1.3) + 1, 64)


def make_runner(key: GemmDesc, device: torch.device) -> Callable[[GemmConfig], None]:
    """A call of the GEMM ``key`` describes (random FP8 operands, groups drawn as the model draws them) with a
    given configuration."""
    from ..testing import draw_group_sizes
    from ..utils import empty_scale_tma
    from . import gemm

    fp8 = torch.float8_e4m3fn
    n, k, g = key.n, key.k, key.num_groups
    kb = ceil_div(k, BLOCK_K)

    def operands(rows: int, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (rows, k) if groups is None else (groups, rows, k)
        x = torch.randn(shape, device=device).to(fp8)
        scale = empty_scale_tma(rows, kb, groups=groups, device=device)
        scale.copy_(torch.rand(scale.shape, device=device) + 0.5)
        return x, scale

    w = torch.randn((g, n, k) if key.layout != "normal" else (n, k), device=device).to(fp8)
    w_scale = torch.rand((*w.shape[:-2], ceil_div(n, 128), kb), device=device) + 0.5

    def act_out(rows: int, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (rows, n // 2) if groups is None else (groups, rows, n // 2)
        return torch.empty(shape, dtype=fp8, device=device), empty_scale_tma(rows, n // 256, groups=groups,
                                                                             device=device)

    ue8m0 = key.act_quant == 2
    if key.layout == "normal":
        x, x_scale = operands(key.m)
        out = torch.empty(key.m, n, dtype=torch.bfloat16, device=device)
        return lambda cfg: gemm.fp8_gemm_hopper(x, x_scale, w, w_scale, out, config=cfg)
    if key.layout == "contiguous":
        sizes = _contiguous_sizes(key)
        m_indices = torch.cat([torch.tensor([i] * s + [-1] * (align(s, 128) - s), dtype=torch.int32)
                               for i, s in enumerate(sizes)]).to(device)
        x, x_scale = operands(m_indices.numel())
        if key.act_quant:
            out, out_scale = act_out(m_indices.numel())
            return lambda cfg: gemm.fp8_grouped_gemm_silu_mul_quant_hopper(
                x, x_scale, w, w_scale, m_indices, None, key.expected_m or 0, ue8m0, out, out_scale, config=cfg)
        out = torch.empty(m_indices.numel(), n, dtype=torch.bfloat16, device=device)
        return lambda cfg: gemm.fp8_grouped_gemm_contiguous_hopper(x, x_scale, w, w_scale, m_indices, out,
                                                                   expected_m=key.expected_m, config=cfg)
    expected = key.expected_m or key.m
    max_m = _masked_max_m(expected)
    masked_m = torch.tensor([min(s, max_m) for s in draw_group_sizes(g, expected, seed=expected)],
                            dtype=torch.int32, device=device)
    x, x_scale = operands(max_m, g)
    if key.act_quant:
        out, out_scale = act_out(max_m, g)
        return lambda cfg: gemm.fp8_grouped_gemm_silu_mul_quant_hopper(
            x, x_scale, w, w_scale, None, masked_m, expected, ue8m0, out, out_scale, config=cfg)
    out = torch.empty(g, max_m, n, dtype=torch.bfloat16, device=device)
    return lambda cfg: gemm.fp8_grouped_gemm_masked_hopper(x, x_scale, w, w_scale, masked_m, expected, out,
                                                           config=cfg)


def time_configs(run: Callable[[GemmConfig], None], configs: Sequence[GemmConfig], reps: int) -> list[float]:
    """Median µs of one ``run(cfg)`` after an L2 flush, per config; the configs interleaved round by round, so
    clock and temperature drift falls on all of them alike."""
    if reps < 1 or not configs:
        raise ValueError(f"time_configs needs configs and reps >= 1, got {len(configs)} configs, reps={reps}")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for cfg in configs:  # first launches: module load, TMA descriptors
        run(cfg)
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in configs]
              for _ in range(reps)]
    for round_events in events:
        for cfg, (start, end) in zip(configs, round_events, strict=True):
            flush.zero_()
            start.record()
            run(cfg)
            end.record()
    torch.cuda.synchronize()
    times = [sorted(1e3 * s.elapsed_time(e) for s, e in (r[i] for r in events)) for i in range(len(configs))]
    return [t[len(t) // 2] for t in times]


def tune_key(key: GemmDesc, configs: Sequence[GemmConfig], *, reps: int = 20,
             min_gain: float = MIN_GAIN) -> TuneResult:
    """Time ``configs`` (the default first) on the current GPU; keep the fastest where a confirming round of it
    against the default, ``2 * reps`` each, shows ``min_gain``."""
    run = make_runner(key, torch.device("cuda", torch.cuda.current_device()))
    times = time_configs(run, configs, reps)
    best = min(range(len(configs)), key=times.__getitem__)
    default, default_us = configs[0], times[0]
    if best == 0:
        return TuneResult(key, default, default, default_us, default_us, len(configs))
    default_us, best_us = time_configs(run, [default, configs[best]], 2 * reps)
    if default_us < (1 + min_gain) * best_us:
        return TuneResult(key, default, default, default_us, default_us, len(configs))
    return TuneResult(key, configs[best], default, best_us, default_us, len(configs))


def plan(descs: Iterable[GemmDesc], limit: int = 6) -> dict[GemmDesc, list[GemmConfig]]:
    """Distinct tuning keys of ``descs`` (first-use order) and the configurations each would time; keys with a
    single candidate (e.g. the fused SiLU·mul + quant GEMM at decode sizes: one 256-wide tile) are left out."""
    out: dict[GemmDesc, list[GemmConfig]] = {}
    seen: set[GemmDesc] = set()
    for desc in descs:
        key = tuning_key(desc)
        if key in seen:
            continue
        seen.add(key)
        cands = tuning_candidates(key, limit)
        if cands[0] != default_config(key):
            raise AssertionError(f"tuning_candidates({key}) must start with the default")
        if len(cands) > 1:
            out[key] = cands
    return out


def model_descs(gemms: Iterable[Any], max_tokens: int, top_k: int, num_sms: int,
                layouts: Sequence[str] = ("normal", "contiguous", "masked")) -> list[GemmDesc]:
    """The descriptors of a model's GEMMs (``warmup.GemmShape`` list) that ``moe-fp8 tune`` measures: warmup's row
    classes of each layout in ``layouts`` (one per tuning key), contiguous row counts under the one-block hint only
    where groups of one block fill them."""
    from ..warmup import shape_descs

    return [desc for g in gemms for layout, _, _, desc in shape_descs(g, max_tokens, top_k, num_sms)
            if layout in layouts
            and not (layout == "contiguous" and desc.expected_m is not None and desc.m > 128 * desc.num_groups)]


def tune(work: Iterable[GemmDesc] | dict[GemmDesc, list[GemmConfig]], *, limit: int = 6, reps: int = 20,
         min_gain: float = MIN_GAIN, jobs: int | None = None, compiler: str | None = None,
         on_result: Callable[[TuneResult], None] | None = None) -> list[TuneResult]:
    """Measure every tuning key of ``work`` (descriptors, or a ``plan`` of keys and their candidates) on the current
    GPU, the candidates compiled first, in parallel, into the JIT cache. Returns one result per key; writes
    nothing (``TunedTable.update`` / ``save`` do)."""
    from ..warmup import Variant, compile_variants
    from .gemm import kernel_variant

    if reps < 1 or not 0 <= min_gain < 1:
        raise ValueError(f"tune needs reps >= 1 and 0 <= min_gain < 1, got reps={reps}, min_gain={min_gain}")
    if not torch.cuda.is_available():
        raise TuneError("tuning measures kernels: it needs a CUDA GPU")
    keys = work if isinstance(work, dict) else plan(work, limit)
    variants: dict[str, Variant] = {}
    for key, configs in keys.items():
        for cfg in configs:
            name, source = kernel_variant(key, cfg)
            variants.setdefault(name, Variant(name, source, key.layout, key.n, key.k, cfg))
    result = compile_variants(list(variants.values()), jobs, compiler)
    if result.failed:
        name, message = result.failed[0]
        raise TuneError(f"{len(result.failed)} candidate kernels failed to compile; {name}: {message.splitlines()[0]} "
                        f"(please report it with `moe-fp8 info`)")
    out = []
    for key, configs in keys.items():
        r = tune_key(key, configs, reps=reps, min_gain=min_gain)
        out.append(r)
        if on_result is not None:
            on_result(r)
    return out


def new_table() -> TunedTable:
    """An empty table for the current GPU."""
    from .. import __version__
    from ..utils import get_num_sms

    name = _current_device_name()
    if name is None:
        raise TuneError("a tuned table belongs to a GPU: none is visible")
    return TunedTable(name, get_num_sms(), kernels=_kernel_sources_hash(), version=__version__)
