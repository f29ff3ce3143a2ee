"""Load cubins and launch kernels through the CUDA driver API (``cuda.bindings.driver``).

``cuda.bindings.driver`` and torch are imported lazily, so this module imports on machines without a
driver or GPU; anything that needs the driver raises ``CudaUnavailableError`` ("no CUDA driver/GPU").

Kernel arguments (``JitKernel.launch(..., args)``), one per kernel parameter, in order:

===========================  ====================================================================
``torch.Tensor``             its ``data_ptr()`` as a pointer (a CUDA tensor on the launch's device)
``None``                     a null pointer
``int``                      sized by the kernel's parameter (4 or 8 bytes, 1/2 for small types);
                             must fit the signed or unsigned range of that size
``float``                    ``float`` (4-byte parameter) or ``double`` (8-byte)
``bool``                     1-byte ``bool`` (or an int of the parameter's size)
``Arg(value, "u32")`` or     an explicit C type: u8 i8 u16 i16 u32 i32 u64 i64 f32 f64 ptr bool;
``(value, "u32")``           checked against the kernel's parameter size
``TmaDesc``                  the 128-byte ``CUtensorMap`` by value (declare the parameter as
                             ``const __grid_constant__ <64-byte aligned 128-byte struct>``)
===========================  ====================================================================

Parameter offsets and sizes come from the driver (``cuKernelGetParamInfo``, CUDA ≥ 12.4), so the host
packing can never disagree with the compiled kernel; a count or size mismatch raises ``TypeError``.
Arguments are packed into a per-thread ``ctypes`` buffer whose ``void**`` is handed to
``cuLaunchKernel`` as a raw address (no per-call cuda.bindings parameter marshalling).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compiler import debug_print

NO_GPU_REASON = "no CUDA driver/GPU"
# Kernels may use up to 48 KiB of dynamic shared memory without opting in.
DEFAULT_MAX_DYNAMIC_SMEM = 48 * 1024
# Largest cluster launchable without CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED.
MAX_PORTABLE_CLUSTER = 8


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


class CudaUnavailableError(CudaError):
    """No CUDA driver library or no GPU on this machine."""


# ---------------------------------------------------------------- driver access

_drv: Any = None
_drv_error: str | None = None
_drv_lock = threading.Lock()


def _driver() -> Any:
    """``cuda.bindings.driver`` after a successful ``cuInit(0)``; raises ``CudaUnavailableError``."""
    global _drv, _drv_error
    if _drv is not None:
        return _drv
    with _drv_lock:
        if _drv is not None:
            return _drv
        if _drv_error is not None:
            raise CudaUnavailableError(_drv_error)
        try:
            from cuda.bindings import driver as drv
        except ImportError as e:
            _drv_error = f"{NO_GPU_REASON}: cuda.bindings.driver not importable ({e})"
            raise CudaUnavailableError(_drv_error) from e
        try:
            (err,) = drv.cuInit(0)
        except Exception as e:  # cuda.bindings raises its own loader error when libcuda is absent
            _drv_error = f"{NO_GPU_REASON}: {type(e).__name__}: {e}"
            raise CudaUnavailableError(_drv_error) from e
        if err != drv.CUresult.CUDA_SUCCESS:
            _drv_error = f"{NO_GPU_REASON}: cuInit(0) returned {_result_str(drv, err)}"
            raise CudaUnavailableError(_drv_error)
        _drv = drv
        return drv


def driver_available() -> tuple[bool, str]:
    """``(True, "")`` when the CUDA driver initializes, else ``(False, reason)``."""
    try:
        _driver()
    except CudaUnavailableError as e:
        return False, str(e)
    return True, ""


def _result_str(drv: Any, err: Any) -> str:
    try:
        _, name = drv.cuGetErrorName(err)
        _, text = drv.cuGetErrorString(err)
        return f"{name.decode()} ({text.decode()})"
    except Exception:
        return str(err)


def check(result: tuple, call: str) -> Any:
    """Unpack a cuda.bindings result tuple ``(CUresult, *values)``; raise ``CudaError`` naming ``call``."""
    err = result[0]
    if err:  # CUresult is an int enum; CUDA_SUCCESS == 0
        raise CudaError(f"{call} failed: {_result_str(_drv, err)}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


# ---------------------------------------------------------------- cubin symbols (no driver needed)

_EM_CUDA = 190
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10


def cubin_entry_functions(cubin: bytes) -> list[str]:
    """Names of the ``__global__`` functions (kernel entries) in an ELF cubin, by parsing its symbol
    table.  Raises ``ValueError`` if ``cubin`` is not a 64-bit little-endian CUDA ELF."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF cubin")
    (machine,) = struct.unpack_from("<H", cubin, 0x12)
    if machine != _EM_CUDA:
        raise ValueError(f"ELF machine {machine} is not EM_CUDA ({_EM_CUDA})")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    if shoff + shnum * shentsize > len(cubin) or shentsize < 64:
        raise ValueError("truncated cubin: section headers out of range")

    def section(i: int) -> tuple[int, int, int, int, int]:
        name, typ, _flags, _addr, off, size, link = struct.unpack_from("<IIQQQQI", cubin, shoff + i * shentsize)
        if off + size > len(cubin) and typ != 8:  # SHT_NOBITS occupies no file space
            raise ValueError(f"truncated cubin: section {i} out of range")
        return name, typ, off, size, link

    def cstr(off: int) -> str:
        end = cubin.index(b"\0", off)
        return cubin[off:end].decode(errors="replace")

    sections = [section(i) for i in range(shnum)]
    entries: list[str] = []
    funcs: list[str] = []
    for _name, typ, off, size, link in sections:
        if typ != 2:  # SHT_SYMTAB
            continue
        str_off = sections[link][2]
        for s in range(off, off + size, 24):
            st_name, st_info, st_other = struct.unpack_from("<IBB", cubin, s)
            if st_info & 0xF != _STT_FUNC or st_name == 0:
                continue
            sym = cstr(str_off + st_name)
            funcs.append(sym)
            if st_other & _STO_CUDA_ENTRY:
                entries.append(sym)
    if not entries:
        # Older toolchains may not flag entries; a kernel always has its own .nv.info.<name> section.
        shstr = sections[shstrndx][2]
        info = {cstr(shstr + n)[len(".nv.info."):] for n, *_ in sections if cstr(shstr + n).startswith(".nv.info.")}
        entries = [f for f in funcs if f in info]
    return entries


def resolve_kernel_name(cubin: bytes, kernel_name: str | None) -> str:
    """The entry symbol to launch: the only one when ``kernel_name`` is None; ``kernel_name`` itself
    when it is an entry symbol; or the unique mangled entry whose C++ name is ``kernel_name``
    (``_Z<len><name>...``).  Raises ``ValueError`` listing the entries otherwise."""
    entries = cubin_entry_functions(cubin)
    if kernel_name is None:
        if len(entries) == 1:
            return entries[0]
        raise ValueError(f"cubin has {len(entries)} kernel entries {entries}; pass kernel_name= to choose one")
    if kernel_name in entries:
        return kernel_name
    prefix = f"_Z{len(kernel_name)}{kernel_name}"
    matches = [e for e in entries if e.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    raise ValueError(f"kernel_name {kernel_name!r} matches {len(matches)} of the cubin's entries {entries}")


# ---------------------------------------------------------------- arguments

# C type → (struct format, size in bytes)
ARG_TYPES: dict[str, tuple[str, int]] = {
    "bool": ("?", 1), "u8": ("B", 1), "i8": ("b", 1), "u16": ("H", 2), "i16": ("h", 2),
    "u32": ("I", 4), "i32": ("i", 4), "u64": ("Q", 8), "i64": ("q", 8),
    "f32": ("f", 4), "f64": ("d", 8), "ptr": ("Q", 8),
}
_UINT_FMT = {1: "B", 2: "H", 4: "I", 8: "Q"}
_FLOAT_FMT = {4: "<f", 8: "<d"}  # standard sizes: a finite value past float32's range raises, not packs inf
_FLT_MAX = 3.4028234663852886e38


class Arg:
    """A kernel argument with an explicit C type, e.g. ``Arg(m, "u32")`` (``(m, "u32")`` works too)."""

    __slots__ = ("ctype", "fmt", "size", "value")

    def __init__(self, value: Any, ctype: str) -> None:
        if ctype not in ARG_TYPES:
            raise ValueError(f"unknown argument type {ctype!r}; expected one of {sorted(ARG_TYPES)}")
        self.value = value
        self.ctype = ctype
        self.fmt, self.size = ARG_TYPES[ctype]

    def __repr__(self) -> str:
        return f"Arg({self.value!r}, {self.ctype!r})"


def _int_bits(value: int, size: int, index: int) -> int:
    """Two's-complement bits of ``value`` in ``size`` bytes; accepts the signed or unsigned range."""
    bits = size * 8
    if not -(1 << (bits - 1)) <= value < (1 << bits):
        raise OverflowError(f"argument {index}: int {value} does not fit the kernel's {size}-byte parameter")
    return value & ((1 << bits) - 1)


# ---------------------------------------------------------------- kernel

class _DeviceState:
    __slots__ = ("func", "max_dynamic_smem", "optin_smem", "static_smem")

    def __init__(self, func: Any) -> None:
        self.func = func
        self.max_dynamic_smem = DEFAULT_MAX_DYNAMIC_SMEM
        self.optin_smem = 0
        self.static_smem = 0


class JitKernel:
    """A compiled kernel: a cubin plus the entry symbol to launch.

    Loading (``cuLibraryLoadData`` + ``cuLibraryGetKernel``) happens on the first ``launch`` or an
    explicit ``load()``; the per-device ``CUfunction`` is fetched once per device.
    """

    def __init__(self, name: str, cubin_path: Path, symbol: str, *, cubin: bytes | None = None,
                 meta: dict | None = None) -> None:
        self.name = name
        self.cubin_path = Path(cubin_path)
        self.symbol = symbol
        self.meta = meta or {}
        self._cubin = cubin
        self._library: Any = None
        self._kernel: Any = None
        self._layout: tuple[tuple[int, int], ...] | None = None  # (offset, size) per parameter
        self._params_size = 0
        self._devices: dict[int, _DeviceState] = {}
        self._tls = threading.local()
        self._configs: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._fast: Any = None  # packer specialized to the argument types of the latest generic pack
        self._fast_budget = 4  # call sites with changing types end up on the generic path

    def __repr__(self) -> str:
        return f"JitKernel({self.name!r}, symbol={self.symbol!r}, cubin={str(self.cubin_path)!r})"

    # ---- metadata

    @property
    def ptxas(self) -> dict[str, int]:
        """ptxas resource report of the entry (registers, spill_stores, spill_loads, stack, smem)."""
        return dict(self.meta.get("ptxas", {}).get(self.symbol, {}))

    @property
    def num_params(self) -> int:
        self.load()
        assert self._layout is not None
        return len(self._layout)

    @property
    def param_layout(self) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` in bytes of each kernel parameter, as the driver reports it."""
        self.load()
        assert self._layout is not None
        return self._layout

    # ---- loading

    def load(self) -> JitKernel:
        """Load the cubin into the driver (idempotent); returns ``self``."""
        if self._kernel is not None:
            return self
        with self._lock:
            if self._kernel is not None:
                return self
            drv = _driver()
            _ensure_torch()
            data = self._cubin if self._cubin is not None else self.cubin_path.read_bytes()
            lib = check(drv.cuLibraryLoadData(data, None, None, 0, None, None, 0),
                        f"cuLibraryLoadData({self.cubin_path})")
            kernel = check(drv.cuLibraryGetKernel(lib, self.symbol.encode()),
                           f"cuLibraryGetKernel({self.symbol})")
            self._layout = _param_layout(drv, kernel, self.symbol)
            self._params_size = max((o + s for o, s in self._layout), default=0)
            self._library = lib
            self._cubin = None  # the driver holds its own copy
            self._kernel = kernel
            debug_print(f"loaded {self.name} ({self.symbol}): params (offset, size) {list(self._layout)}")
        return self

    def _device_state(self, dev: int) -> _DeviceState:
        """Per-device handle and limits; ``dev`` must be the current device (its context is used)."""
        st = self._devices.get(dev)
        if st is not None:
            return st
        # the context first: cuKernelGetParamInfo (in load) fails without one, as in a thread that launches
        # before it ever touched the CUDA runtime
        _ensure_context(dev)
        self.load()
        drv = _drv
        func = check(drv.cuKernelGetFunction(self._kernel), f"cuKernelGetFunction({self.symbol})")
        st = _DeviceState(func)
        attr = drv.CUfunction_attribute
        st.static_smem = check(drv.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func),
                               "cuFuncGetAttribute(SHARED_SIZE_BYTES)")
        # the dynamic limit before any opt-in: 48 KiB less the static shared memory, not 48 KiB (a kernel with a
        # static counter failed its launch at exactly 48 KiB dynamic instead of raising the limit)
        st.max_dynamic_smem = check(drv.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, func),
                                    "cuFuncGetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        cu_dev = check(drv.cuDeviceGet(dev), f"cuDeviceGet({dev})")
        st.optin_smem = check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, cu_dev),
            "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")
        self._devices[dev] = st
        return st

    def function_handle(self, device: int | None = None) -> Any:
        """The ``CUfunction`` of this kernel for ``device`` (default: torch's current device); loads
        the kernel into that device's context if needed."""
        if device is None or device == _current_device():
            return self._device_state(_current_device()).func
        import torch

        with torch.cuda.device(device):
            return self._device_state(device).func

    # ---- launching

    def launch(self, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any], *,
               smem_bytes: int = 0, stream: Any = None, cluster: Sequence[int] = (1, 1, 1),
               pdl: bool = False) -> None:
        """Launch on ``stream`` (default: torch's current stream of the current device).

        ``grid``/``block``/``cluster`` are ints or 1-3 ints; ``smem_bytes`` is the dynamic shared memory
        per block (above 48 KiB the kernel's limit is raised once per device, up to the device's opt-in
        maximum minus the kernel's static shared memory).  With ``cluster != (1, 1, 1)`` or ``pdl`` the
        launch uses ``cuLaunchKernelEx`` with a cluster-dimension attribute and / or programmatic stream
        serialization (the kernel may start before the previous one on the stream ends: it must
        ``griddepcontrol.wait`` before reading that kernel's outputs).  See the module docstring for ``args``.
        """
        dev = _current_device()
        st = self._devices.get(dev) or self._device_state(dev)
        if smem_bytes > st.max_dynamic_smem:
            self._raise_smem_limit(st, smem_bytes)
        if stream is None:
            stream = _current_stream(dev)
        elif not isinstance(stream, int):
            stream = int(getattr(stream, "cuda_stream", stream))
        g = grid if type(grid) is tuple and len(grid) == 3 else _dim3(grid, "grid")
        b = block if type(block) is tuple and len(block) == 3 else _dim3(block, "block")
        tls = self._tls
        try:
            state = tls.state
        except AttributeError:
            state = tls.state = _make_param_buffer(self._layout or (), self._params_size)
        fast = self._fast
        params = state[2] if fast is not None and fast(args, state[0], state[1], dev) else self._pack(args, dev)
        drv = _drv
        if cluster == (1, 1, 1) and not pdl:
            err = drv.cuLaunchKernel(st.func, g[0], g[1], g[2], b[0], b[1], b[2], smem_bytes, stream,
                                     params, 0)[0]
            if err:
                if err == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT and _ensure_context(dev, force=True):
                    params = self._pack(args, dev)
                    err = drv.cuLaunchKernel(st.func, g[0], g[1], g[2], b[0], b[1], b[2], smem_bytes,
                                             stream, params, 0)[0]
                if err:
                    raise CudaError(f"cuLaunchKernel({self.symbol}, grid={g}, block={b}, smem={smem_bytes}) "
                                    f"failed: {_result_str(drv, err)}")
            return
        c = cluster if type(cluster) is tuple and len(cluster) == 3 else _dim3(cluster, "cluster")
        cfg = self._launch_config(g, b, c, smem_bytes, stream, pdl)
        err = drv.cuLaunchKernelEx(cfg, st.func, params, 0)[0]
        if err == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT and _ensure_context(dev, force=True):
            err = drv.cuLaunchKernelEx(cfg, st.func, self._pack(args, dev), 0)[0]
        if err:
            raise CudaError(f"cuLaunchKernelEx({self.symbol}, grid={g}, block={b}, cluster={c}, "
                            f"pdl={pdl}, smem={smem_bytes}) failed: {_result_str(drv, err)}")

    __call__ = launch

    def _raise_smem_limit(self, st: _DeviceState, smem_bytes: int) -> None:
        limit = st.optin_smem - st.static_smem
        if smem_bytes > limit:
            raise ValueError(f"{self.name}: smem_bytes={smem_bytes} exceeds the device limit {limit} "
                             f"(opt-in {st.optin_smem} - static {st.static_smem})")
        drv = _drv
        # under the lock the limit only grows: two threads raising it at once cannot leave the smaller one set
        # while the larger is recorded
        with self._lock:
            if smem_bytes <= st.max_dynamic_smem:
                return
            check(drv.cuFuncSetAttribute(
                st.func, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes),
                f"cuFuncSetAttribute({self.symbol}, MAX_DYNAMIC_SHARED_SIZE_BYTES={smem_bytes})")
            st.max_dynamic_smem = smem_bytes

    def _launch_config(self, g: tuple[int, int, int], b: tuple[int, int, int], c: tuple[int, int, int],
                       smem_bytes: int, stream: int, pdl: bool = False) -> Any:
        key = (g, b, c, smem_bytes, stream, pdl)
        cfg = self._configs.get(key)
        if cfg is not None:
            return cfg
        if any(gi % ci for gi, ci in zip(g, c, strict=True)):
            raise ValueError(f"grid {g} is not divisible by cluster {c}")
        if c[0] * c[1] * c[2] > MAX_PORTABLE_CLUSTER:
            raise ValueError(f"cluster {c} has more than {MAX_PORTABLE_CLUSTER} blocks (non-portable size)")
        drv = _drv
        attrs = []
        if c != (1, 1, 1):
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = c
            attrs.append(attr)
        if pdl:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b
        cfg.sharedMemBytes = smem_bytes
        cfg.hStream = drv.CUstream(stream)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        if len(self._configs) > 256:
            self._configs.clear()
        self._configs[key] = cfg
        return cfg

    def _pack(self, args: Sequence[Any], dev: int) -> int:
        """Write ``args`` into this thread's parameter buffer; return the ``void**`` address. Tensors must be
        on CUDA device ``dev`` (the launch's): another device's pointer would fault or read the wrong memory.

        The generic (checked, ~1 µs per argument) path; after a success the argument types are
        compiled into a specialized packer (``_compile_packer``) that later launches try first.
        """
        ptrs = self._pack_generic(args, dev)
        if self._fast_budget > 0:  # (re)specialize to these types, a bounded number of times
            self._fast_budget -= 1
            self._fast = _compile_packer(self._layout or (), args)
        return ptrs

    def _pack_generic(self, args: Sequence[Any], dev: int) -> int:
        layout = self._layout
        assert layout is not None
        if len(args) != len(layout):
            raise TypeError(f"{self.name} ({self.symbol}) takes {len(layout)} arguments, got {len(args)}")
        tls = self._tls
        try:
            buf, _, ptrs_addr, _ = tls.state
        except AttributeError:
            tls.state = _make_param_buffer(layout, self._params_size)
            buf, _, ptrs_addr, _ = tls.state
        pack_into = struct.pack_into
        for i, a in enumerate(args):
            off, size = layout[i]
            t = type(a)
            if t is _Tensor or (t is not int and t is not float and isinstance(a, _Tensor)):
                if size != 8:
                    raise TypeError(f"argument {i}: tensor passed for a {size}-byte parameter")
                _check_device(a, dev, i, "tensor")
                pack_into("Q", buf, off, a.data_ptr())
            elif (t is int or t is bool) and size not in _UINT_FMT:
                raise TypeError(f"argument {i}: {t.__name__} passed for a {size}-byte parameter (a TMA descriptor?)")
            elif t is int:
                pack_into(_UINT_FMT[size], buf, off, _int_bits(a, size, i))
            elif t is _TmaDesc or isinstance(a, _TmaDesc):
                if size != 128:
                    raise TypeError(f"argument {i}: TMA descriptor passed for a {size}-byte parameter")
                pack_into("128s", buf, off, a.raw)
            elif t is float:
                fmt = _FLOAT_FMT.get(size)
                if fmt is None:
                    raise TypeError(f"argument {i}: float passed for a {size}-byte parameter")
                try:
                    pack_into(fmt, buf, off, a)
                except (OverflowError, struct.error) as e:
                    raise OverflowError(f"argument {i}: float {a!r} does not fit the kernel's {size}-byte "
                                        f"parameter ({e})") from None
            elif t is Arg or t is tuple:
                arg = a if t is Arg else Arg(*a)
                if arg.size != size:
                    raise TypeError(f"argument {i}: {arg!r} is {arg.size} bytes, the kernel parameter is {size}")
                v = arg.value
                if arg.ctype == "ptr":
                    if isinstance(v, _Tensor):
                        _check_device(v, dev, i, "ptr tensor")
                        v = v.data_ptr()
                    pack_into("Q", buf, off, _int_bits(v or 0, size, i))
                    continue
                try:  # the C type's own range: Arg(2**31, "i32") or Arg(-1, "u32") is refused, not wrapped
                    pack_into("<" + arg.fmt, buf, off, v)
                except (struct.error, OverflowError) as e:
                    raise TypeError(f"argument {i}: {arg!r} cannot be packed as {arg.ctype}: {e}") from None
            elif a is None:
                if size != 8:
                    raise TypeError(f"argument {i}: None (null pointer) passed for a {size}-byte parameter")
                pack_into("Q", buf, off, 0)
            elif t is bool:
                pack_into(_UINT_FMT[size], buf, off, int(a))
            else:
                raise TypeError(f"argument {i}: unsupported type {t.__name__} "
                                "(tensor, int, float, bool, None, Arg, (value, ctype) or TmaDesc)")
        return ptrs_addr


def _check_device(t: Any, dev: int, index: int, what: str) -> None:
    got = t.get_device()
    if got < 0:
        raise TypeError(f"argument {index}: {what} is on {t.device}, not a CUDA device")
    if got != dev:
        raise TypeError(f"argument {index}: {what} is on cuda:{got}, but the launch is on cuda:{dev} "
                        "(make its device current: torch.cuda.device)")


def _compile_packer(layout: tuple[tuple[int, int], ...], args: Sequence[Any]) -> Any:
    """A function ``fast(args, buf, base, dev) -> bool`` specialized to the types of ``args``: it writes
    them into the parameter buffer ``buf`` (at address ``base``) and returns True.

    It re-checks every argument's exact type (and, for tensors, device ``dev`` / int range) and returns False on any
    mismatch, so the caller falls back to the generic packer, which raises the precise error.  All
    parameters, TMA descriptors included (``128s``), are written by one ``struct.pack_into`` call
    (~0.4 µs; a ctypes ``memmove`` alone costs ~1 µs).  Returns None when an argument type is not specializable (Arg, tuple).
    """
    ns: dict[str, Any] = {"pack_into": struct.pack_into, "INF": float("inf")}
    checks: list[str] = []
    cuda_checks: list[str] = []
    writes: list[tuple[int, int, str, str]] = []  # (offset, size, struct fmt, value expression)
    n = len(layout)
    for i, (a, (off, size)) in enumerate(zip(args, layout, strict=True)):
        t = type(a)
        ns[f"T{i}"] = t
        checks.append(f"type(a{i}) is T{i}")
        if a is None:
            writes.append((off, size, "Q", "0"))
        elif t is bool:
            writes.append((off, size, _UINT_FMT[size], f"a{i}"))
        elif t is int:
            bits = size * 8
            checks.append(f"{-(1 << (bits - 1))} <= a{i} < {1 << bits}")
            writes.append((off, size, _UINT_FMT[size], f"(a{i} & {(1 << bits) - 1})"))
        elif t is float:
            if size == 4:  # finite values past float32's range fall back to the generic packer, which raises
                checks.append(f"not {_FLT_MAX!r} < abs(a{i}) < INF")
            writes.append((off, size, _FLOAT_FMT[size][1:], f"a{i}"))
        elif isinstance(a, _TmaDesc):
            writes.append((off, size, f"{size}s", f"a{i}.raw"))
        elif isinstance(a, _Tensor):
            cuda_checks.append(f"a{i}.get_device() == dev")
            writes.append((off, size, "Q", f"a{i}.data_ptr()"))
        else:
            return None
    lines = ["def fast(args, buf, base, dev):", f"    if len(args) != {n}:", "        return False"]
    if n:
        lines.append(f"    {', '.join(f'a{i}' for i in range(n))}{',' if n == 1 else ''} = args")
        lines.append(f"    if not ({' and '.join(checks + cuda_checks)}):")
        lines.append("        return False")
    # one pack_into for everything ('x' = alignment padding between parameters, written as zeros)
    writes.sort()
    fmt, pos = "<", 0
    for off, size, f, _ in writes:
        fmt += "x" * (off - pos) + f
        pos = off + size
    if writes:
        lines.append(f"    pack_into({fmt!r}, buf, 0, {', '.join(v for *_, v in writes)})")
    lines.append("    return True")
    # NOTE: the code is generated from the kernel's parameter layout and argument types only.
    exec("\n".join(lines), ns)
    return ns["fast"]


def _make_param_buffer(layout: tuple[tuple[int, int], ...], total: int) -> tuple[Any, int, int, tuple]:
    """(writable view, its address, address of the void* array, objects to keep alive)."""
    # NOTE: 64-byte alignment (CUtensorMap's) is not needed since the driver copies bytes; it is free.
    raw = ctypes.create_string_buffer(max(total, 1) + 64)
    base = (ctypes.addressof(raw) + 63) & ~63
    view = (ctypes.c_char * max(total, 1)).from_address(base)
    ptrs = (ctypes.c_void_p * max(len(layout), 1))(*[base + off for off, _ in layout])
    return view, base, ctypes.addressof(ptrs) if layout else 0, (raw, ptrs)


def _param_layout(drv: Any, kernel: Any, symbol: str) -> tuple[tuple[int, int], ...]:
    """``(offset, size)`` of every parameter via ``cuKernelGetParamInfo`` (CUDA driver ≥ 12.4)."""
    get_info = getattr(drv, "cuKernelGetParamInfo", None)
    if get_info is None:
        raise CudaError("cuda.bindings lacks cuKernelGetParamInfo (needs cuda-bindings >= 12.4); "
                        "cannot check kernel arguments")
    layout = []
    count = None
    get_count = getattr(drv, "cuKernelGetParamCount", None)
    if get_count is not None:
        try:
            res = get_count(kernel)
            if not res[0]:
                count = int(res[1])
        except Exception:
            count = None  # driver older than the binding: fall back to probing
    i = 0
    while count is None or i < count:
        res = get_info(kernel, i)
        if res[0]:
            if count is None and res[0] == drv.CUresult.CUDA_ERROR_INVALID_VALUE:
                break  # probed past the last parameter
            raise CudaError(f"cuKernelGetParamInfo({symbol}, {i}) failed: {_result_str(drv, res[0])}")
        layout.append((int(res[1]), int(res[2])))
        i += 1
    return tuple(layout)


# ---------------------------------------------------------------- torch glue (lazy)

_Tensor: Any = type("_NoTensor", (), {})
_TmaDesc: Any = type("_NoTmaDesc", (), {})
_get_device: Any = None
_get_raw_stream: Any = None


def _bind_types() -> None:
    """Bind the argument types the packers recognize (torch.Tensor, TmaDesc); needs no GPU."""
    global _Tensor, _TmaDesc
    import torch

    from .tma import TmaDesc

    _Tensor = torch.Tensor
    _TmaDesc = TmaDesc


def _ensure_torch() -> None:
    """Bind torch's fast current-device / current-stream accessors (once)."""
    global _get_device, _get_raw_stream
    if _get_device is not None:
        return
    import torch

    _bind_types()
    if not torch.cuda.is_available():
        raise CudaUnavailableError(f"{NO_GPU_REASON}: torch.cuda.is_available() is False")
    torch.cuda.init()
    c = torch._C
    if hasattr(c, "_cuda_getDevice") and hasattr(c, "_cuda_getCurrentRawStream"):
        _get_raw_stream = c._cuda_getCurrentRawStream
        _get_device = c._cuda_getDevice
    else:  # public API fallback (slower)
        _get_raw_stream = lambda dev: torch.cuda.current_stream(dev).cuda_stream  # noqa: E731
        _get_device = torch.cuda.current_device


def _current_device() -> int:
    if _get_device is None:
        _ensure_torch()
    return _get_device()


def _current_stream(dev: int) -> int:
    """The ``cudaStream_t`` (as an int) of torch's current stream on device ``dev``: where ``launch``
    runs by default."""
    if _get_raw_stream is None:
        _ensure_torch()
    return _get_raw_stream(dev)


# Each device's primary context, retained once for the life of the process (as the CUDA runtime holds it): a
# retain per call would raise its reference count on every new thread and every retried launch.
_PRIMARY: dict[int, object] = {}


def _ensure_context(dev: int, force: bool = False) -> bool:
    """Make ``dev``'s primary context current on this thread if none is (threads that never touched
    the CUDA runtime have none) or the current one is another device's.  Returns True if it changed the
    current context."""
    drv = _driver()
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    cu_dev = check(drv.cuDeviceGet(dev), f"cuDeviceGet({dev})")
    if ctx is not None and int(ctx) != 0 and not force \
            and int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice")) == int(cu_dev):
        return False
    primary = _PRIMARY.get(dev)
    if primary is None:
        primary = _PRIMARY[dev] = check(drv.cuDevicePrimaryCtxRetain(cu_dev), f"cuDevicePrimaryCtxRetain({dev})")
    if ctx is not None and int(ctx) == int(primary):
        return False
    check(drv.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    return True


def _dim3(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    if isinstance(v, int):
        t = (v, 1, 1)
    else:
        t = tuple(int(x) for x in v)
        if not 1 <= len(t) <= 3:
            raise ValueError(f"{what} must be an int or 1-3 ints, got {v!r}")
        t = t + (1,) * (3 - len(t))
    if any(x < 1 for x in t):
        raise ValueError(f"{what} dimensions must be >= 1, got {t}")
    return t  # type: ignore[return-value]
