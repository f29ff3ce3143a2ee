"""TMA descriptors (``CUtensorMap``) encoded on the host with ``cuTensorMapEncodeTiled``.

A descriptor is passed to a kernel *by value*: declare the parameter as
``const __grid_constant__ TmaDescriptor desc`` where ``TmaDescriptor`` is a 64-byte aligned 128-byte
struct (``CUtensorMap`` from ``<cuda.h>`` works under nvcc but not NVRTC), and use ``&desc`` as the
tensor-map operand of ``cp.async.bulk.tensor``.

Dimensions are given innermost first, in *elements*: ``inner`` is the contiguous dimension.  All
descriptors use: no interleave, L2 promotion 256 B, out-of-bounds elements filled with zeros, element
strides 1.  Encoded descriptors are cached in a small LRU keyed by everything that goes into them.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from .runtime import _driver, check

SWIZZLE_BYTES: dict[str, int] = {"none": 0, "32B": 32, "64B": 64, "128B": 128}
# TMA limits (CUDA driver API, cuTensorMapEncodeTiled)
MAX_RANK = 5
MAX_BOX = 256
GMEM_ALIGN = 16
MAX_STRIDE = 1 << 40
MAX_DIM = 1 << 32
TMA_CACHE_SIZE = 4096

# torch dtype -> (CUtensorMapDataType member name, element bytes)
_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.uint8: ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    torch.int8: ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    torch.float8_e4m3fn: ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    torch.float8_e5m2: ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    torch.bfloat16: ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2),
    torch.float16: ("CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2),
    torch.float32: ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4),
    torch.int32: ("CU_TENSOR_MAP_DATA_TYPE_INT32", 4),
}
_SWIZZLE_ENUM = {
    "none": "CU_TENSOR_MAP_SWIZZLE_NONE", "32B": "CU_TENSOR_MAP_SWIZZLE_32B",
    "64B": "CU_TENSOR_MAP_SWIZZLE_64B", "128B": "CU_TENSOR_MAP_SWIZZLE_128B",
}


class TmaDesc:
    """An encoded 128-byte ``CUtensorMap`` plus what it describes (dims/strides/box innermost first)."""

    __slots__ = ("_buf", "address", "box", "data_ptr", "dims", "dtype", "raw", "strides_bytes", "swizzle")

    def __init__(self, raw: bytes, *, data_ptr: int, dtype: torch.dtype, dims: tuple[int, ...],
                 strides_bytes: tuple[int, ...], box: tuple[int, ...], swizzle: str) -> None:
        if len(raw) != 128:
            raise ValueError(f"a CUtensorMap is 128 bytes, got {len(raw)}")
        self.raw = bytes(raw)  # what kernel launches pack (one struct.pack_into per launch)
        self._buf = (ctypes.c_ubyte * 128).from_buffer_copy(raw)
        self.address = ctypes.addressof(self._buf)  # for APIs that want a CUtensorMap* (cuda.bindings)
        self.data_ptr = data_ptr
        self.dtype = dtype
        self.dims = dims
        self.strides_bytes = strides_bytes
        self.box = box
        self.swizzle = swizzle

    def __repr__(self) -> str:
        return (f"TmaDesc(ptr=0x{self.data_ptr:x}, dtype={self.dtype}, dims={self.dims}, "
                f"strides_bytes={self.strides_bytes}, box={self.box}, swizzle={self.swizzle})")


# ---------------------------------------------------------------- validation (pure, CPU-testable)

def validate_tma(*, data_ptr: int, elem_bytes: int, dims: Sequence[int], strides_elems: Sequence[int],
                 box: Sequence[int], swizzle: str, tensor_extent_elems: int | None = None) -> tuple[int, ...]:
    """Check a tiled TMA description against the hardware rules; return the strides in bytes.

    ``dims``/``box``/``strides_elems`` are innermost first; ``strides_elems[0]`` must be 1.  When
    ``tensor_extent_elems`` is given, the described region must lie inside it (no reads past the
    tensor).  Raises ``ValueError`` naming the rule and the values.
    """
    rank = len(dims)
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"TMA rank must be 1..{MAX_RANK}, got {rank}")
    if len(box) != rank or len(strides_elems) != rank:
        raise ValueError(f"dims {tuple(dims)}, strides {tuple(strides_elems)} and box {tuple(box)} "
                         "must have the same length")
    if swizzle not in SWIZZLE_BYTES:
        raise ValueError(f"swizzle must be one of {list(SWIZZLE_BYTES)}, got {swizzle!r}")
    if data_ptr % GMEM_ALIGN:
        raise ValueError(f"TMA global address 0x{data_ptr:x} is not {GMEM_ALIGN}-byte aligned")
    if strides_elems[0] != 1:
        raise ValueError(f"the innermost TMA dimension must be contiguous (stride 1), got {strides_elems[0]}")
    for i, d in enumerate(dims):
        if not 1 <= d <= MAX_DIM:
            raise ValueError(f"TMA dim {i} = {d} must be in 1..{MAX_DIM}")
    for i, b in enumerate(box):
        if not 1 <= b <= MAX_BOX:
            raise ValueError(f"TMA box dim {i} = {b} must be in 1..{MAX_BOX}")
    strides_bytes = tuple(s * elem_bytes for s in strides_elems)
    for i in range(1, rank):
        sb = strides_bytes[i]
        if sb % GMEM_ALIGN or not 0 < sb < MAX_STRIDE:
            raise ValueError(f"TMA stride of dim {i} = {strides_elems[i]} elements = {sb} bytes must be a "
                             f"positive multiple of {GMEM_ALIGN} below 2^40")
    if rank > 1 and strides_bytes[1] < dims[0] * elem_bytes:
        raise ValueError(f"TMA stride of dim 1 ({strides_elems[1]} elements) is smaller than dim 0 "
                         f"({dims[0]} elements): rows would overlap")
    inner_box_bytes = box[0] * elem_bytes
    if inner_box_bytes % 16:
        raise ValueError(f"TMA inner box = {box[0]} elements = {inner_box_bytes} bytes must be a multiple of 16")
    span = SWIZZLE_BYTES[swizzle]
    if span and inner_box_bytes > span:
        raise ValueError(f"TMA inner box = {inner_box_bytes} bytes exceeds the {swizzle} swizzle span "
                         f"({span} bytes)")
    if tensor_extent_elems is not None:
        region = 1 + sum((d - 1) * s for d, s in zip(dims, strides_elems, strict=True))
        if region > tensor_extent_elems:
            raise ValueError(f"TMA region (dims {tuple(dims)}, strides {tuple(strides_elems)} elements) spans "
                             f"{region} elements, past the tensor's {tensor_extent_elems}")
    return strides_bytes


def _tensor_extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        raise ValueError("cannot describe an empty tensor with TMA")
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"negative strides {t.stride()} are not supported by TMA")
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def infer_strides(shape: Sequence[int], stride: Sequence[int], dims: Sequence[int]) -> tuple[int, ...] | None:
    """Element strides for TMA ``dims`` (innermost first) read straight from a tensor's layout.

    TMA dims are memory-ordered (dim 0 contiguous), so the tensor's dims are taken by increasing stride
    (a row-major tensor reversed; the column-major FP32 scales ``[M, KG]`` stride ``(1, M_pad)`` as
    ``(M, KG)``).  To lower the rank, the outermost dims are merged when they tile each other
    (``stride[outer] == size[inner] * stride[inner]``) *and* keep their logical order (``[G, N, K]`` →
    ``(K, G*N)``); a merge that would reorder rows (e.g. of a transposed view) is refused.  Size-1 dims
    are dropped or appended as needed.  Each described dim must be ≤ the tensor's.  Returns None when
    the layout does not match, in which case the caller must pass strides explicitly.
    """
    rank = len(dims)
    # increasing stride; among equal strides the later (more inner) torch dim first
    order = sorted(range(len(shape)), key=lambda i: (stride[i], -i))
    pairs = [[shape[i], stride[i], i] for i in order] or [[1, 1, 0]]
    while len(pairs) > rank:
        # a size-1 dim can always go (its stride never addresses anything); prefer the outermost one
        ones = [j for j in range(1, len(pairs)) if pairs[j][0] == 1]
        if ones:
            del pairs[ones[-1]]
            continue
        j = len(pairs) - 2  # else merge the two outermost dims, if they tile each other in order
        inner, outer = pairs[j], pairs[j + 1]
        if outer[1] != inner[0] * inner[1] or outer[2] > inner[2]:
            return None
        pairs[j] = [inner[0] * outer[0], inner[1], outer[2]]
        del pairs[j + 1]
    while len(pairs) < rank:  # described size-1 outer dims: stride = extent so far
        pairs.append([1, pairs[-1][0] * pairs[-1][1], -1])
    if pairs[0][1] != 1 or any(d > p[0] for d, p in zip(dims, pairs, strict=True)):
        return None
    return tuple(p[1] for p in pairs)


# ---------------------------------------------------------------- encoding + LRU

_cache: OrderedDict[tuple, TmaDesc] = OrderedDict()
_cache_lock = threading.Lock()


def clear_tma_cache() -> None:
    """Forget all cached descriptors."""
    with _cache_lock:
        _cache.clear()


def make_tma(tensor: torch.Tensor, dims: Sequence[int], box: Sequence[int], *, swizzle: str = "128B",
             strides_elems: Sequence[int] | None = None) -> TmaDesc:
    """A rank-1..5 tiled descriptor over ``tensor`` (dims/box/strides innermost first, in elements).

    ``strides_elems`` defaults to ``infer_strides`` of the tensor's layout; a layout it cannot match
    raises ``ValueError`` asking for explicit strides.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    dims_t = tuple(int(d) for d in dims)
    box_t = tuple(int(b) for b in box)
    if strides_elems is None:
        inferred = infer_strides(tuple(tensor.shape), tuple(tensor.stride()), dims_t)
        if inferred is None:
            raise ValueError(f"cannot infer TMA strides for dims {dims_t} from tensor shape {tuple(tensor.shape)}"
                             f" stride {tuple(tensor.stride())}; pass the strides explicitly")
        strides_t = inferred
    else:
        strides_t = tuple(int(s) for s in strides_elems)
    ptr = tensor.data_ptr()
    # shape/stride are in the key because the bounds check below depends on the tensor's extent
    key = (tensor.device.index, ptr, tensor.dtype, tensor.shape, tensor.stride(), dims_t, strides_t, box_t,
           swizzle)
    with _cache_lock:
        desc = _cache.get(key)
        if desc is not None:
            _cache.move_to_end(key)
            return desc
    if not tensor.is_cuda:
        raise ValueError(f"TMA needs a CUDA tensor, got one on {tensor.device}")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"TMA dtype {tensor.dtype} not supported; expected one of {list(_DTYPES)}")
    dtype_name, elem = _DTYPES[tensor.dtype]
    strides_bytes = validate_tma(data_ptr=ptr, elem_bytes=elem, dims=dims_t, strides_elems=strides_t,
                                 box=box_t, swizzle=swizzle, tensor_extent_elems=_tensor_extent(tensor))
    raw = _encode(dtype_name, ptr, dims_t, strides_bytes, box_t, swizzle)
    desc = TmaDesc(raw, data_ptr=ptr, dtype=tensor.dtype, dims=dims_t, strides_bytes=strides_bytes,
                   box=box_t, swizzle=swizzle)
    with _cache_lock:
        _cache[key] = desc
        if len(_cache) > TMA_CACHE_SIZE:
            _cache.popitem(last=False)
    return desc


def make_tma_2d(tensor: torch.Tensor, gmem_inner: int, gmem_outer: int, box_inner: int, box_outer: int, *,
                swizzle: str = "128B", outer_stride_elems: int | None = None) -> TmaDesc:
    """2-D descriptor: ``gmem_inner`` contiguous elements per row, ``gmem_outer`` rows.

    ``outer_stride_elems`` (row pitch in elements) defaults to the tensor's own layout: row-major
    ``[.., outer, inner]`` (leading dims merged) or column-major ``[inner, outer]`` with stride
    ``(1, pitch)`` as the FP32 activation scales use.  Example: ``x_fp8 [M, K]`` → ``make_tma_2d(x, K, M,
    128, BLOCK_M)``; ``x_scale [M, K/128]`` stride ``(1, M_pad)`` → ``make_tma_2d(s, M, K // 128, BLOCK_M, 1,
    swizzle="none")``.
    """
    strides = None if outer_stride_elems is None else (1, outer_stride_elems)
    return make_tma(tensor, (gmem_inner, gmem_outer), (box_inner, box_outer), swizzle=swizzle,
                    strides_elems=strides)


def make_tma_3d(tensor: torch.Tensor, gmem_inner: int, gmem_mid: int, gmem_outer: int, box_inner: int,
                box_mid: int, box_outer: int, *, swizzle: str = "128B", mid_stride_elems: int | None = None,
                outer_stride_elems: int | None = None) -> TmaDesc:
    """3-D descriptor (e.g. grouped weights ``w [G, N, K]`` → ``make_tma_3d(w, K, N, G, 128, BLOCK_N, 1)``).

    Strides default to the tensor's layout; give both ``mid_stride_elems`` and ``outer_stride_elems``
    or neither.
    """
    if (mid_stride_elems is None) != (outer_stride_elems is None):
        raise ValueError("give both mid_stride_elems and outer_stride_elems, or neither")
    strides = None if mid_stride_elems is None else (1, mid_stride_elems, outer_stride_elems)
    return make_tma(tensor, (gmem_inner, gmem_mid, gmem_outer), (box_inner, box_mid, box_outer),
                    swizzle=swizzle, strides_elems=strides)  # type: ignore[arg-type]


def _encode(dtype_name: str, ptr: int, dims: tuple[int, ...], strides_bytes: tuple[int, ...],
            box: tuple[int, ...], swizzle: str) -> bytes:
    drv: Any = _driver()
    u32, u64 = drv.cuuint32_t, drv.cuuint64_t
    rank = len(dims)
    tmap = check(drv.cuTensorMapEncodeTiled(
        getattr(drv.CUtensorMapDataType, dtype_name), rank, ptr,
        [u64(d) for d in dims], [u64(s) for s in strides_bytes[1:]],
        [u32(b) for b in box], [u32(1)] * rank,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(drv.CUtensorMapSwizzle, _SWIZZLE_ENUM[swizzle]),
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    ), f"cuTensorMapEncodeTiled(dims={dims}, strides_bytes={strides_bytes}, box={box}, swizzle={swizzle})")
    return ctypes.string_at(tmap.getPtr(), 128)
