"""Backend registry and selection: which implementation runs an op on a device.

Backends, in order of preference (DESIGN §3):

- ``hopper``    — JIT-compiled CUDA kernels for sm_90a. Usable when the tensor is on a CUDA device of
                  compute capability (9, 0), a JIT compiler is found
                  (``moe_fp8.kernels.jit.compiler.find_compilers``) and the op has a Hopper kernel.
- ``portable``  — Triton kernels for any recent CUDA GPU (``moe_fp8.kernels.triton``: the MoE data-path ops;
                  the GEMMs have none yet). Usable when the tensor is on a CUDA device and Triton imports.
- ``reference`` — ``moe_fp8.reference`` (pure PyTorch): always usable, on CPU too.

``select(op, device)`` returns ``(backend_name, fn)``:

- CPU tensors use ``reference`` (the only backend that runs there; not a fallback).
- CUDA tensors use the first usable backend of hopper → portable → reference. Choosing a later one
  than the first backend that *applies* to the device (hopper applies to capability (9, 0) devices,
  portable to every CUDA device) is a **fallback**: it is logged once on ``logging.getLogger("moe_fp8")``
  at WARNING with every skipped backend's reason, and is an error (``BackendError``) under
  ``MOE_FP8_STRICT=1``.
- ``MOE_FP8_BACKEND=hopper|portable|reference`` forces that backend for every op; if it cannot run
  the op on the device, ``select`` raises ``BackendError`` (never falls back). ``auto`` or unset: the
  order above.

Selection is cached per ``(op, device, MOE_FP8_BACKEND, MOE_FP8_STRICT)``, so a call costs two
environment reads and one dict lookup (< 1 µs) on the eager launch path; changing either variable
takes effect on the next call. ``register`` and ``clear_cache`` drop the cache.

Implementations are registered per ``(op, backend)`` either as a callable or lazily as a
``"module:attr"`` string, imported the first time the backend is otherwise usable on a device (so a CPU
machine never imports the CUDA launch code). Calling conventions per op are listed in ``moe_fp8.ops``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable

import torch

from .utils import env, truthy

__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "ENV_STRICT",
    "BackendError",
    "available_backends",
    "clear_cache",
    "explain",
    "implementations",
    "register",
    "select",
]

BACKENDS = ("hopper", "portable", "reference")
ENV_BACKEND = "MOE_FP8_BACKEND"
ENV_STRICT = "MOE_FP8_STRICT"
_AUTO = ("", "auto")
HOPPER_CAPABILITY = (9, 0)

logger = logging.getLogger("moe_fp8")


class BackendError(RuntimeError):
    """A forced backend cannot run an op, or strict mode forbids the fallback that selection needs."""


@dataclasses.dataclass(frozen=True)
class _Probe:
    ok: bool
    reason: str
    applies: bool  # the backend is meant for this kind of device (skipping it there is a fallback)


# op -> backend -> callable or "module:attr"
_impls: dict[str, dict[str, Callable | str]] = {}
_select_cache: dict[tuple, tuple[str, Callable]] = {}
_probe_cache: dict[tuple[str, torch.device], _Probe] = {}
_resolve_errors: dict[tuple[str, str], str] = {}
_logged: set[tuple] = set()


def register(op: str, backend: str, fn: Callable | str) -> None:
    """Register ``fn`` as ``backend``'s implementation of ``op`` (replacing any previous one).

    ``fn`` is a callable, or a ``"package.module:function"`` string imported lazily on first use. The
    calling convention of each op is documented in ``moe_fp8.ops``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not (callable(fn) or (isinstance(fn, str) and ":" in fn)):
        raise TypeError(f"fn must be a callable or a 'module:attr' string, got {fn!r}")
    _impls.setdefault(op, {})[backend] = fn
    _resolve_errors.pop((op, backend), None)
    clear_cache()


def implementations(op: str) -> tuple[str, ...]:
    """Backends with an implementation registered for ``op`` (importability not checked)."""
    return tuple(b for b in BACKENDS if b in _impls.get(op, {}))


def known_ops() -> tuple[str, ...]:
    """Every op with at least one registered implementation."""
    return tuple(sorted(_impls))


def clear_cache() -> None:
    """Forget cached selections, device probes and once-logged fallbacks (tests, re-registration)."""
    _select_cache.clear()
    _probe_cache.clear()
    _logged.clear()


# --------------------------------------------------------------------------------------------
# device-level probes
# --------------------------------------------------------------------------------------------

def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _probe_hopper(device: torch.device) -> _Probe:
    if device.type != "cuda":
        return _Probe(False, f"needs a CUDA device, got {device.type}", False)
    if not torch.cuda.is_available():
        return _Probe(False, f"CUDA is not available (torch {torch.__version__}, built for CUDA "
                             f"{torch.version.cuda})", False)
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(index)
    if tuple(cap) != HOPPER_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return _Probe(False, f"needs compute capability {HOPPER_CAPABILITY} (sm_90a); {name} has "
                             f"{tuple(cap)}", False)
    try:
        from moe_fp8.kernels.jit.compiler import find_compilers
        compilers = list(find_compilers())
    except Exception as exc:  # absent or broken JIT package: report, never crash selection
        return _Probe(False, f"JIT compiler probe failed ({_error_text(exc)})", True)
    found = [c for c in compilers if getattr(c, "available", False)]
    if not found:
        why = "; ".join(f"{getattr(c, 'name', '?')}: {getattr(c, 'reason', '?')}" for c in compilers)
        return _Probe(False, f"no JIT compiler found ({why or 'none probed'})", True)
    c = found[0]
    return _Probe(True, f"sm_90a via {getattr(c, 'name', '?')} {getattr(c, 'version', '')}".rstrip(), True)


def _probe_portable(device: torch.device) -> _Probe:
    applies = device.type == "cuda"
    if not any("portable" in impls for impls in _impls.values()):
        return _Probe(False, "not implemented yet", applies)
    if not applies:
        return _Probe(False, f"needs a CUDA device, got {device.type}", False)
    if not torch.cuda.is_available():
        return _Probe(False, "CUDA is not available", False)
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return _Probe(False, f"triton is not importable ({_error_text(exc)})", True)
    return _Probe(True, "Triton", True)


def _probe(backend: str, device: torch.device) -> _Probe:
    key = (backend, device)
    hit = _probe_cache.get(key)
    if hit is None:
        if backend == "hopper":
            hit = _probe_hopper(device)
        elif backend == "portable":
            hit = _probe_portable(device)
        else:
            hit = _Probe(True, "pure PyTorch (moe_fp8.reference), any device", True)
        _probe_cache[key] = hit
    return hit


def _normalize_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                else torch.device("cpu"))
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def available_backends(device: torch.device | str | int | None = None) -> dict[str, tuple[bool, str]]:
    """``name -> (available, reason)`` for each backend on ``device`` (default: current CUDA device, else CPU).

    Device-level only (an available backend may still lack a kernel for some op: see ``explain``).
    Never raises.
    """
    dev = _normalize_device(device)
    out = {}
    for name in BACKENDS:
        p = _probe(name, dev)
        out[name] = (p.ok, p.reason)
    return out


# --------------------------------------------------------------------------------------------
# op-level resolution and selection
# --------------------------------------------------------------------------------------------

def _resolve(op: str, backend: str) -> tuple[Callable | None, str]:
    """The callable for ``(op, backend)`` (importing a lazy one), or ``(None, reason)``."""
    fn = _impls.get(op, {}).get(backend)
    if fn is None:
        return None, f"no {backend} implementation of {op}"
    if callable(fn):
        return fn, ""
    err = _resolve_errors.get((op, backend))
    if err is not None:
        return None, err
    module, _, attr = fn.partition(":")
    try:
        resolved = getattr(importlib.import_module(module), attr)
    except Exception as exc:
        err = f"{module}.{attr} is not importable ({_error_text(exc)})"
        _resolve_errors[(op, backend)] = err
        return None, err
    _impls[op][backend] = resolved
    return resolved, ""


def _usable(op: str, backend: str, device: torch.device) -> tuple[Callable | None, str, bool]:
    p = _probe(backend, device)
    if not p.ok:
        return None, p.reason, p.applies
    fn, why = _resolve(op, backend)
    return fn, (why or p.reason), p.applies


def explain(op: str, device: torch.device | str | int | None = None) -> list[tuple[str, bool, str]]:
    """``[(backend, usable, reason)]`` for ``op`` on ``device``, in preference order (for ``moe-fp8 info``)."""
    dev = _normalize_device(device)
    rows = []
    for name in BACKENDS:
        fn, reason, _ = _usable(op, name, dev)
        rows.append((name, fn is not None, reason))
    return rows


def select(op: str, device: torch.device) -> tuple[str, Callable]:
    """``(backend_name, fn)`` that runs ``op`` for tensors on ``device`` (see the module docstring).

    Raises ``BackendError`` when ``MOE_FP8_BACKEND`` forces a backend that cannot run ``op`` there,
    or when ``MOE_FP8_STRICT=1`` and only a fallback could; ``ValueError`` for an unknown op or an
    unknown ``MOE_FP8_BACKEND`` value.
    """
    key = (op, device, env(ENV_BACKEND), env(ENV_STRICT))
    hit = _select_cache.get(key)
    if hit is not None:
        return hit
    hit = _select_uncached(op, device, key[2], key[3])
    _select_cache[key] = hit
    return hit


# Under torch.compile the name is read once, at trace time, a constant of the graph: traced, select's caches and
# probes would become guards that fail as soon as they fill (a recompile per new entry).
@torch.compiler.assume_constant_result
def selected(op: str, device: torch.device) -> str:
    """The name of the backend ``select`` picks for ``op`` on ``device`` (``moe_fp8.backend`` normalises the
    device first)."""
    return select(op, device)[0]


def _select_uncached(op: str, device: torch.device, forced: str | None, strict: str | None
                     ) -> tuple[str, Callable]:
    if op not in _impls:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(known_ops())}")
    device = _normalize_device(device)
    forced_name = (forced or "").strip().lower()
    if forced_name not in _AUTO:
        if forced_name not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND} must be one of {(*BACKENDS, 'auto')}, got {forced!r}")
        fn, reason, _ = _usable(op, forced_name, device)
        if fn is None:
            raise BackendError(f"{ENV_BACKEND}={forced_name} but backend {forced_name!r} cannot run "
                               f"{op} on {device}: {reason}")
        return forced_name, fn

    skipped: list[tuple[str, str, bool]] = []
    for name in BACKENDS:
        fn, reason, applies = _usable(op, name, device)
        if fn is not None:
            break
        skipped.append((name, reason, applies))
    else:  # pragma: no cover - reference is registered for every op by moe_fp8.ops
        raise BackendError(f"no backend can run {op} on {device}: "
                           + "; ".join(f"{n}: {r}" for n, r, _ in skipped))

    missed = [(n, r) for n, r, applies in skipped if applies]
    if missed:
        why = "; ".join(f"{n}: {r}" for n, r in missed)
        if truthy(strict):
            raise BackendError(f"{ENV_STRICT}=1: {op} on {device} would fall back to backend {name!r} ({why})")
        # A backend missing on the whole device (no JIT compiler, Triton not importable) makes every op
        # fall back for one cause: warn once per device and cause, not once per op (nine warnings).
        # An op without a kernel in an available backend is its own cause: once per op.
        unavailable = tuple(n for n, _ in missed if not _probe(n, device).ok)
        once = (device, unavailable) if unavailable else (op, device, name)
        if once not in _logged:
            _logged.add(once)
            also = (f"; every other op that {' / '.join(unavailable)} would run falls back too, without another "
                    f"warning (`moe-fp8 info` shows why; {ENV_STRICT}=1 makes it an error)" if unavailable else "")
            logger.warning("moe_fp8: %s on %s falls back to backend %r (%s)%s", op, device, name, why, also)
    return name, fn
