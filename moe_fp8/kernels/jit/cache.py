"""On-disk JIT cache: compile each kernel variant once per machine, load it many times.

Layout under ``$MOE_FP8_CACHE_DIR`` (default ``~/.cache/moe_fp8``)::

    <name>-<key[:16]>/kernel.cubin    the sm_90a cubin
                     /kernel.cu       the exact source compiled
                     /compile.log     compiler output (ptxas -v report)
                     /meta.json       key, compiler, flags, cubin sha256 + size, ptxas report
    locks/<name>-<key[:16]>.lock      one file lock per variant
    failed/<name>-<key[:16]>/         source + log of the last failed compile
    compile-journal.log               one line per compile (who, when, how long)

Key = sha256 of (kernel name, generated source, every file of the include tree, compiler name +
version + flags, extra flags).  An entry is compiled into a temporary directory inside the cache and
published with one atomic ``os.replace``; the per-key lock makes N processes compile a variant once.
Before use, ``meta.json`` and the cubin's size and sha256 are checked: a corrupt or incomplete entry is
logged, removed and rebuilt, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock

from .compiler import (
    CUBIN_FILE,
    LOG_FILE,
    SOURCE_FILE,
    Compiler,
    JitCompileError,
    debug_print,
    get_compiler,
)
from .runtime import JitKernel, resolve_kernel_name

log = logging.getLogger("moe_fp8.jit")

ENV_CACHE_DIR = "MOE_FP8_CACHE_DIR"
META_FILE = "meta.json"
JOURNAL_FILE = "compile-journal.log"
ENTRY_FORMAT = 1
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}")
# The folder name of an entry (``_entry_dir``). Other tools may keep folders of their own in the cache
# directory; only names of this shape (under the root or failed/) are ever counted or deleted as entries.
_ENTRY_RE = re.compile(_NAME_RE.pattern + r"-[0-9a-f]{16}")


class JitCacheError(OSError):
    """The cache directory cannot be created or written; the message names it and the fix."""


def cache_dir() -> Path:
    """The cache root: ``$MOE_FP8_CACHE_DIR`` or ``~/.cache/moe_fp8`` (read on every call)."""
    return Path(os.environ.get(ENV_CACHE_DIR) or "~/.cache/moe_fp8").expanduser()


def include_dir() -> Path:
    """The package's CUDA header tree, ``moe_fp8/kernels/include`` (passed as ``-I``, hashed into keys)."""
    return Path(__file__).resolve().parent.parent / "include"


# ---------------------------------------------------------------- keys

_tree_hash_memo: dict[str, tuple[tuple, str]] = {}


def include_tree_hash(root: Path | None = None) -> str:
    """sha256 over (relative path, content) of every file under ``root`` (default ``include_dir()``).

    Memoized on the tree's (path, size, mtime) listing, so editing a header changes the hash while an
    unchanged tree costs only a directory walk.
    """
    root = Path(root) if root is not None else include_dir()
    files: list[tuple[str, Path]] = []
    if root.is_dir():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for fn in sorted(filenames):
                p = Path(dirpath) / fn
                files.append((p.relative_to(root).as_posix(), p))
    files.sort()
    listing = tuple((rel, st.st_size, st.st_mtime_ns) for rel, st in ((r, p.stat()) for r, p in files))
    memo = _tree_hash_memo.get(str(root))
    if memo is not None and memo[0] == listing:
        return memo[1]
    digest = _hash_files(files)
    _tree_hash_memo[str(root)] = (listing, digest)
    return digest


def _hash_files(files: list[tuple[str, Path]]) -> str:
    """sha256 over (relative path, sha256 of content) of ``files``, in the order given."""
    h = hashlib.sha256()
    for rel, p in files:
        h.update(rel.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


_QUOTED_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)


def include_closure_hash(entry: str, root: Path | None = None) -> str:
    """sha256 over (relative path, content) of the header ``entry`` (relative to ``root``, default
    ``include_dir()``) and of every header it includes by quotes, transitively: what one kernel's code
    depends on, where ``include_tree_hash`` covers every kernel's."""
    root = (Path(root) if root is not None else include_dir()).resolve()
    seen: dict[str, Path] = {}
    todo = [root / entry]
    while todo:
        path = todo.pop().resolve()
        rel = path.relative_to(root).as_posix()
        if rel in seen:
            continue
        if not path.is_file():
            raise FileNotFoundError(f"{rel}: included but not under {root}")
        seen[rel] = path
        todo.extend(path.parent / inc for inc in _QUOTED_INCLUDE_RE.findall(path.read_text()))
    return _hash_files(sorted(seen.items()))


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"kernel name {name!r} must match {_NAME_RE.pattern} (it names a cache directory)")


def cache_key(name: str, source: str, *, compiler: str | Compiler | None = None,
              flags: Sequence[str] = ()) -> str:
    """The full sha256 key of a variant (see module docstring)."""
    _check_name(name)
    comp = compiler if isinstance(compiler, Compiler) else get_compiler(compiler)
    return _key(name, source, comp, tuple(flags), include_tree_hash(include_dir()))


def _key(name: str, source: str, comp: Compiler, flags: tuple[str, ...], tree_hash: str) -> str:
    h = hashlib.sha256()
    for part in (f"moe_fp8-jit-entry-v{ENTRY_FORMAT}", name, source, tree_hash,
                 comp.identity(), "\n".join(flags)):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------- entries

def _entry_dir(root: Path, name: str, key: str) -> Path:
    return root / f"{name}-{key[:16]}"


def _load_entry(entry: Path, key: str) -> tuple[bytes, dict] | str:
    """(cubin bytes, meta) of a complete entry, or the reason it is not usable."""
    try:
        meta = json.loads((entry / META_FILE).read_text())
    except FileNotFoundError:
        return "meta.json missing"
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    if not isinstance(meta, dict) or meta.get("key") != key or meta.get("format") != ENTRY_FORMAT:
        return "meta.json does not match the key"
    try:
        cubin = (entry / CUBIN_FILE).read_bytes()
    except OSError as e:
        return f"cubin unreadable ({e})"
    if len(cubin) != meta.get("cubin_size"):
        return f"cubin is {len(cubin)} bytes, meta.json says {meta.get('cubin_size')}"
    if hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
        return "cubin sha256 does not match meta.json"
    return cubin, meta


def _remove_dir(path: Path) -> None:
    """Rename aside (atomic disappearance), then delete. Only entry folders: anything else is a bug."""
    if not _ENTRY_RE.fullmatch(path.name):
        raise ValueError(f"refusing to delete {path}: not a JIT cache entry folder")
    trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _journal(root: Path, line: str) -> None:
    """Best effort: the entry is published already, so a journal that cannot be written must not fail the build."""
    try:
        with open(root / JOURNAL_FILE, "a") as f:  # one short O_APPEND write per compile
            f.write(line + "\n")
    except OSError as e:
        debug_print(f"could not append to {root / JOURNAL_FILE}: {e}")


# ---------------------------------------------------------------- build

_memory: dict[tuple, JitKernel] = {}
_memory_lock = threading.Lock()


def clear_memory_cache() -> None:
    """Forget the in-process kernels (the next ``build`` re-checks the disk cache and header tree)."""
    with _memory_lock:
        _memory.clear()


def build(name: str, source: str, *, kernel_name: str | None = None, compiler: str | Compiler | None = None,
          flags: Sequence[str] = ()) -> JitKernel:
    """Compile (if not cached) and return the kernel ``name`` generated as ``source``.

    ``name`` names the cache entry (``[A-Za-z0-9_.-]``, e.g. ``"fp8_gemm_n7168_k2048_bm128"``);
    ``kernel_name`` picks the entry symbol when the cubin has several (exact symbol, or the C++ name of a
    unique mangled entry); ``compiler`` overrides ``$MOE_FP8_JIT_COMPILER``; ``flags`` are extra compiler
    flags (part of the key).  The cubin is loaded into the driver lazily, on the first launch.
    Raises ``JitCompileError`` (with ``.path`` to the saved source + log) when compilation fails.
    """
    comp = compiler if isinstance(compiler, Compiler) else get_compiler(compiler)
    flags_t = tuple(flags)
    # NOTE: the in-process memo skips the header-tree hash (a stat of every header); edited headers
    # are picked up by new processes or after clear_memory_cache().
    mkey = (name, source, kernel_name, comp.name, comp.version, flags_t)
    k = _memory.get(mkey)
    if k is not None:
        return k
    _check_name(name)
    inc = include_dir()
    tree_hash = include_tree_hash(inc)
    key = _key(name, source, comp, flags_t, tree_hash)
    root = cache_dir()
    entry = _entry_dir(root, name, key)
    t0 = time.perf_counter()
    got = _load_entry(entry, key)
    if isinstance(got, str):
        got = _build_locked(root, entry, name, key, source, comp, inc, tree_hash, flags_t, got)
    else:
        debug_print(f"cache hit {entry} ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
    cubin, meta = got
    symbol = resolve_kernel_name(cubin, kernel_name)
    k = JitKernel(name, entry / CUBIN_FILE, symbol, cubin=cubin, meta=meta)
    with _memory_lock:
        k = _memory.setdefault(mkey, k)
    return k


def is_cached(name: str, source: str, *, compiler: str | Compiler | None = None, flags: Sequence[str] = ()) -> bool:
    """True when ``build(name, source, ...)`` would load a complete entry without compiling.

    Hashes the source and the header tree and checks the entry (no lock, no compiler run), so
    ``moe-fp8 warmup`` can tell hits from misses before it starts any compile process."""
    _check_name(name)
    comp = compiler if isinstance(compiler, Compiler) else get_compiler(compiler)
    key = _key(name, source, comp, tuple(flags), include_tree_hash(include_dir()))
    return not isinstance(_load_entry(_entry_dir(cache_dir(), name, key), key), str)


def _lock_dir(root: Path) -> Path:
    """``root/locks``, created; an unusable cache root raises ``JitCacheError`` with the fix."""
    locks = root / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        if not os.access(locks, os.W_OK | os.X_OK):
            raise PermissionError(f"no write permission on {locks}")
    except OSError as e:
        # NOTE: this is the first write of a build; without this message a read-only home directory
        # shows up as a bare PermissionError traceback from deep inside a kernel call.
        raise JitCacheError(f"JIT cache directory {root} is not writable ({type(e).__name__}: {e}); set "
                            f"{ENV_CACHE_DIR} to a writable directory (compiled kernels are stored there)") from e
    return locks


def _build_locked(root: Path, entry: Path, name: str, key: str, source: str, comp: Compiler, inc: Path,
                  tree_hash: str, flags: tuple[str, ...], why: str) -> tuple[bytes, dict]:
    locks = _lock_dir(root)
    with FileLock(str(locks / f"{entry.name}.lock")):
        got = _load_entry(entry, key)  # another process may have built it while we waited
        if not isinstance(got, str):
            debug_print(f"cache hit after waiting for the lock: {entry}")
            return got
        if entry.exists():
            log.warning("moe_fp8 JIT cache entry %s is corrupt or incomplete (%s); rebuilding it", entry, got)
            _remove_dir(entry)
        else:
            debug_print(f"cache miss {entry} ({why})")
        for stale in root.glob(f".tmp-{entry.name}-*"):  # left by a killed compile of this key
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; entries are plain readable files
        try:
            try:
                res = comp.compile_ex(source, name, [inc], tmp, flags)
            except JitCompileError as e:
                failed = root / "failed" / entry.name
                failed.parent.mkdir(exist_ok=True)
                _remove_dir(failed)
                os.replace(tmp, failed)
                flog = e.log.replace(str(tmp), str(failed))
                (failed / LOG_FILE).write_text(flog)
                raise JitCompileError(str(e).replace(str(tmp), str(failed)), log=flog, path=failed) from None
            cubin = res.cubin.read_bytes()
            meta = {
                "format": ENTRY_FORMAT, "key": key, "name": name,
                "compiler": comp.name, "compiler_version": comp.version, "compiler_path": comp.info.path,
                "flags": comp.flags() + list(flags), "include_dir": str(inc),
                "include_tree_sha256": tree_hash,
                "cubin_size": len(cubin), "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
                "compile_seconds": round(res.seconds, 3), "ptxas": res.ptxas,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(), "pid": os.getpid(),
            }
            # meta.json is written last: its presence marks a complete temporary directory
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
            try:
                os.replace(tmp, entry)
            except OSError:
                # only a writer that ignores the lock can get here; keep its entry if it is complete
                other = _load_entry(entry, key)
                if isinstance(other, str):
                    raise
                return other
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _journal(root, f"{meta['created']} pid={os.getpid()} host={meta['host']} compiled {entry.name} "
                       f"key={key} with {comp.name} {comp.version} in {res.seconds:.2f}s")
        return cubin, meta


def _is_entry(path: Path) -> bool:
    """A published entry: an entry-shaped folder with ``meta.json``, which is written last, just before the
    atomic publication (a folder without it is not the cache's, or not finished)."""
    return _ENTRY_RE.fullmatch(path.name) is not None and (path / META_FILE).is_file()


def _tree_bytes(path: Path) -> int:
    size = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # removed while we walked
                size += (Path(dirpath) / f).stat().st_size
    return size


def cache_info() -> dict:
    """``{"dir": str, "entries": int, "bytes": int}`` of the cache: entries = published variants; bytes =
    what the cache itself holds (entries, failed/, locks/, temporary build folders, its files at the root).

    Other folders in the cache directory (e.g. virtualenvs someone put there) are neither counted nor sized.
    """
    root = cache_dir()
    entries = 0
    size = 0
    if root.is_dir():
        with contextlib.suppress(OSError):
            for d in root.iterdir():
                if d.is_symlink():
                    continue
                if d.is_file():
                    with contextlib.suppress(OSError):
                        size += d.stat().st_size
                elif _is_entry(d):
                    entries += 1
                    size += _tree_bytes(d)
                elif d.name in ("locks", "failed") or d.name.startswith((".tmp-", ".trash-")):
                    size += _tree_bytes(d)
    return {"dir": str(root), "entries": entries, "bytes": size}


__all__ = [
    "LOG_FILE",
    "SOURCE_FILE",
    "JitCacheError",
    "build",
    "cache_dir",
    "cache_info",
    "cache_key",
    "clear_memory_cache",
    "include_closure_hash",
    "include_dir",
    "include_tree_hash",
    "is_cached",
]
