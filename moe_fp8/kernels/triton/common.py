"""Helpers shared by the Triton data-path kernels: bit-exact FP8 encoding and scales, sort keys, launch checks.

Bit-exactness with ``moe_fp8.reference`` rests on three rules used by every kernel here:

1. Divisions that the reference performs as tensor / tensor are ``tl.div_rn`` (IEEE, correctly
   rounded); Triton's ``/`` on float32 is an approximate division on NVIDIA GPUs.
2. FP32 → FP8 e4m3fn is round-to-nearest-even of a value already clamped to ±448. On sm_89+ the
   hardware ``cvt.rn.satfinite.e4m3x2.f32`` does exactly that; elsewhere (and in Triton's
   interpreter, whose cast truncates) ``fp8_e4m3_code`` does it with integer arithmetic.
3. Non-finite groups are handled explicitly (NaN never relies on how a max reduction treats it).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ...utils import env, truthy

FP8_MAX = 448.0


# ============================================================================================
# Host side
# ============================================================================================

def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return truthy(env("TRITON_INTERPRET"))


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def native_fp8(device: torch.device) -> bool:
    """Use the hardware FP32→e4m3 conversion (sm_89+, compiled kernels only)."""
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9)


def native_cvt(device: torch.device) -> bool:
    """Use hardware float conversions (compiled kernels; Triton's interpreter rounds float casts wrongly)."""
    return device.type == "cuda" and not interpreting()


@functools.cache
def _pdl_available() -> bool:
    """This Triton can launch with programmatic dependent launch and emit ``griddepcontrol``."""
    try:
        import triton.language.extra.cuda as tl_cuda
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl_cuda, "gdc_wait")


def use_pdl(device: torch.device) -> bool:
    """Launch the data-path kernels with programmatic dependent launch (sm_90+, compiled kernels; see
    ``pdl_start``). ``MOE_FP8_PDL=0`` turns it off (A/B measurements)."""
    if device.type != "cuda" or interpreting() or not truthy(env("MOE_FP8_PDL") or "1"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (9, 0) and _pdl_available()


_PDL_ARGS: dict[tuple, dict[str, bool]] = {}


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments of a data-path kernel launch on ``device``: its ``PDL`` constexpr (``pdl_start``)
    and, when on, Triton's ``launch_pdl`` option (omitted when off: older Tritons lack the option). Cached per
    device and switches (a launch reads them every call: ~5 µs uncached on the H100 machine)."""
    key = (device, env("MOE_FP8_PDL"), env("TRITON_INTERPRET"))
    args = _PDL_ARGS.get(key)
    if args is None:
        args = _PDL_ARGS[key] = {"PDL": True, "launch_pdl": True} if use_pdl(device) else {"PDL": False}
    return dict(args)


# Compiled kernels by (kernel, device, Triton's specialization of the arguments, launch options)
_COMPILED: dict[tuple, Any] = {}
_COMPILED_MAX = 4096
_fast_launch = True  # off for good once this Triton's internals are not the ones used below


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, with Triton's per-call dispatch done once per call signature.

    On every call Triton binds and specializes each argument, formats a cache key from the options and reads
    its environment knobs: 30-70 µs of host time per data-path launch on the H100 machine, against ~10 µs for
    the compiled kernel's own launcher. Here the first call of a signature goes through Triton (compiling if
    needed) and keeps the compiled kernel; later calls bind the arguments with that kernel's Triton binder
    (so the same specialization: dtypes, 16-byte alignment, ints equal to 1 or multiples of 16, constexprs,
    options), find the kernel under it and call its launcher directly, on torch's current stream as Triton
    does. The interpreter, ``MOE_FP8_TRITON_FAST_LAUNCH=0``, anything but a plain ``@triton.jit`` kernel and
    Tritons whose internals differ take Triton's path. Triton's environment knobs (e.g. ``TRITON_DEBUG``) are
    read when a signature is first seen.
    """
    global _fast_launch
    if (not _fast_launch or type(kernel) is not JITFunction or interpreting()
            or not truthy(env("MOE_FP8_TRITON_FAST_LAUNCH") or "1")):
        kernel[grid](*args, **kwargs)
        return
    compiled = key = None
    try:
        hooks = triton.knobs.runtime
        dev = torch._C._cuda_getDevice()
        stream = torch._C._cuda_getCurrentRawStream(dev)
        bound, spec, options = kernel.device_caches[dev][4](*args, **kwargs)
        key = (id(kernel), dev, tuple(spec), tuple(options.items()))
        compiled = _COMPILED.get(key)
    except (AttributeError, IndexError):  # not the Triton internals this was written against
        _fast_launch = False
    except (TypeError, ValueError):  # bad arguments: Triton's own path raises its error
        key = None
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if key is not None and _fast_launch and hasattr(compiled, "packed_metadata"):
            if len(_COMPILED) >= _COMPILED_MAX:
                _COMPILED.clear()
            _COMPILED[key] = compiled
        return
    g = (*grid, 1, 1)
    values = bound.values()
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *values), hooks.launch_enter_hook, hooks.launch_exit_hook,
                 *values)


def check_launch_device(*tensors: torch.Tensor | None) -> torch.device:
    """The device the kernels run on; refuses CPU tensors unless the interpreter is on.

    ``moe_fp8.backends`` never routes CPU tensors here (CPU uses ``reference``); this guards direct
    calls, where a compiled kernel given host pointers would fault instead of raising.
    """
    device = next(t.device for t in tensors if t is not None)
    for t in tensors:
        if t is not None and t.device != device:
            raise ValueError(f"all tensors must be on {device}, got one on {t.device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    return device


# ============================================================================================
# Device side
# ============================================================================================

@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of every data-path kernel. With ``PDL`` (launched with ``launch_pdl``) the kernel's
    programs become resident while the previous kernel on the stream still runs: they wait here for it to
    complete and its writes to be visible — before any memory access, since it may still be reading what
    this kernel writes (the decode workspace is reused in turn) — and then let the next kernel launch.
    Every PDL kernel waits, so a kernel's completion still implies that of all earlier ones. Between
    kernels of a few microseconds (a decode step) this hides the launch latency."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """Hint the lines at ``ptrs`` (valid addresses) into L2, for a PDL kernel to call before
    ``pdl_start``: its programs are resident while the previous kernel runs, so the lines arrive during
    that wait. Safe even if the previous kernel writes them: L2 is the point of coherence of the GPU and
    a prefetch fills no L1, so the load after the wait reads the final data. Without ``PDL`` (or in
    the interpreter, which has no inline PTX) nothing."""
    if PDL:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fp8_e4m3_code(q, NATIVE: tl.constexpr):
    """uint8 e4m3fn code of float32 ``q`` (finite, ``|q| <= 448``), rounded to nearest even.

    Software path: a normal result (``|q| >= 2**-6``) rounds the FP32 mantissa to 3 bits with the
    usual add-half-minus-one-plus-odd trick (a carry moves into the exponent on its own); a
    subnormal result is ``|q| * 2**9`` rounded to an integer by adding ``2**23`` (where FP32's ulp is
    exactly 1). Signed zeros and tiny negatives keep their sign bit, as torch's cast does.
    """
    if NATIVE:
        code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = q.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        odd = (mag >> 20) & 1
        normal = ((mag + 0x7FFFF + odd) >> 20) - (120 << 3)  # rebias exponent 127 -> 7
        abs_q = mag.to(tl.float32, bitcast=True)
        sub = (abs_q * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        code = (tl.where(mag >= (121 << 23), normal, sub) | sign).to(tl.uint8)
    return code


@triton.jit
def to_bf16(x, NATIVE: tl.constexpr):
    """float32 → bfloat16, round to nearest even (NaN stays NaN)."""
    if NATIVE:
        out = x.to(tl.bfloat16)
    else:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        rounded = tl.where(x != x, 0x7FC0, rounded)
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def round_up_pow2(s):
    """Smallest power of two >= ``s`` for float32 ``s > 0`` (+Inf stays +Inf), exactly as the
    reference's frexp/ldexp: an exact power of two is kept, anything above goes to the next one."""
    # Subnormal scales (only with a tiny eps) are lifted by 2**64 first, so the bit trick below
    # sees a normal number; scaling back by 2**-64 is exact for a power of two.
    tiny = s < 1.1754943508222875e-38
    t = tl.where(tiny, s * 18446744073709551616.0, s)
    bits = t.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    bump = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    p = ((exponent + bump) << 23).to(tl.float32, bitcast=True)
    return tl.where(tiny, p * 5.421010862427522e-20, p)


@triton.jit
def scale_from_amax(amax, has_nan, eps, UE8M0: tl.constexpr):
    """``max(amax, eps) / 448`` correctly rounded (power of two with UE8M0); NaN where ``has_nan``."""
    scale = tl.div_rn(tl.maximum(amax, eps), 448.0)
    if UE8M0:
        scale = round_up_pow2(scale)
    return tl.where(has_nan, float("nan"), scale)


@triton.jit
def quantize_exact(y, scale, NATIVE: tl.constexpr):
    """FP8 codes of float32 ``y [..., group]`` with one ``scale [...]`` per group (``scale > 0`` or not
    finite): ``fp8(clamp(y / scale, ±448))``.

    ``y / scale`` is correctly rounded without a division per element (an IEEE division is ~10
    instructions and bound the quantizing kernels: the EP-rank scatter at 8192 tokens took 98.7 us
    with it, 77.0 without): ``r = RN(1 / scale)`` once per group, ``q0 = RN(y·r)`` is within an ulp of
    the quotient, and one FMA correction ``q0 + (y - q0·scale)·r`` (the residual is exact) rounds it
    correctly (Markstein's theorem; checked against numpy's division on every FP32 mantissa of the
    scale). A zero ``q0`` is kept as it is, so ``-0.0`` stays negative. Scales below 2**-64 (a tiny
    ``eps``) divide ``y·2**64`` by ``scale·2**64`` (exact scalings, the same quotient): their reciprocal
    could overflow, and the residual underflow where it decides a code.
    A non-finite scale (the group held NaN or ±Inf) makes every code NaN (0x7F), as the reference.
    """
    lift = tl.where(scale < 5.421010862427522e-20, 18446744073709551616.0, 1.0)
    s = scale * lift
    r = tl.expand_dims(tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), s), -1)
    s = tl.expand_dims(s, -1)
    y = y * tl.expand_dims(lift, -1)
    q0 = y * r
    q = tl.where(q0 == 0.0, q0, tl.fma(tl.fma(-q0, s, y), r, q0))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    finite = tl.abs(s) < float("inf")
    q = tl.where(finite, q, 0.0)  # keep the encoder's input finite; overwritten just below
    return tl.where(finite, fp8_e4m3_code(q, NATIVE), 0x7F).to(tl.uint8)


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_groups(x, eps, UE8M0: tl.constexpr, NATIVE: tl.constexpr):
    """``(codes uint8, scales)`` of float32 ``x [..., group]`` (a group along the last axis), one scale
    per group, exactly as the reference's per-token-group quantization. Masked-off lanes must hold 0:
    they never raise amax nor flag NaN."""
    LAST: tl.constexpr = len(x.shape) - 1  # (the interpreter's tl.reduce mis-shapes axis -1)
    amax = tl.reduce(tl.abs(x), LAST, _max_propagating_nan)  # NaN exactly when the group holds one
    scale = scale_from_amax(amax, amax != amax, eps, UE8M0)
    return quantize_exact(x, scale, NATIVE), scale


@triton.jit
def sort_key(v):
    """int32 key whose signed order is the order ``torch.sort`` uses for float32 ``v``.

    -0.0 and +0.0 are equal, every NaN is above +Inf (and all NaNs are equal).
    """
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(v != v, 0x7FFFFFFF, key)
