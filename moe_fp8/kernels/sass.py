"""SASS inspection: find cuobjdump / nvdisasm, disassemble a cubin, count instructions by opcode.

Used by tests to check that a kernel really issues what it should (``QGMMA`` for FP8 wgmma, no
``LDL``/``STL`` local-memory spills).  Tools are looked up in the PyPI wheels
(``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm``), then ``$CUDA_HOME/bin`` (and ``$CUDA_PATH``,
``/usr/local/cuda``), then ``PATH``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from .jit.compiler import nvidia_wheel_dirs


class SassToolNotFoundError(RuntimeError):
    """Neither cuobjdump nor nvdisasm could be found."""


def _wheel_bins(tool: str) -> list[Path]:
    # cu13 wheels: nvidia/cu13/bin/<tool>; cu12 wheels: nvidia/cuda_<tool>/bin/<tool>
    return [d / tool for d in nvidia_wheel_dirs("bin") if (d / tool).is_file()]


def _find_tool(tool: str) -> str | None:
    cands = _wheel_bins(tool)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "bin" / tool)
    cands.append(Path("/usr/local/cuda/bin") / tool)
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which(tool)


def cuobjdump_path() -> str | None:
    """Path of ``cuobjdump`` or None."""
    return _find_tool("cuobjdump")


def nvdisasm_path() -> str | None:
    """Path of ``nvdisasm`` or None."""
    return _find_tool("nvdisasm")


def dump_sass(cubin: Path | str) -> str:
    """SASS text of a cubin (``cuobjdump -sass``, else ``nvdisasm``).

    Raises ``SassToolNotFoundError`` when neither tool exists, ``RuntimeError`` when the tool fails.
    """
    cubin = Path(cubin)
    if not cubin.is_file():
        raise FileNotFoundError(f"cubin {cubin} does not exist")
    tool = cuobjdump_path()
    if tool is not None:
        cmd = [tool, "-sass", str(cubin)]
    else:
        tool = nvdisasm_path()
        if tool is None:
            raise SassToolNotFoundError(
                "neither cuobjdump nor nvdisasm found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
                "or set CUDA_HOME to a toolkit that has them)")
        cmd = [tool, "-c", str(cubin)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc={res.returncode}): {res.stderr.strip()}")
    return res.stdout


# "/*0030*/   @!P0 QGMMA.64x8x32.F32.E4M3.E4M3 ..." -- both cuobjdump and nvdisasm prefix each
# instruction with its address; cuobjdump's encoding lines ("/* 0x000fe2... */") do not match.
_INSN_RE = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s*(?:\{\s*)?(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def opcodes(sass: str) -> list[str]:
    """Every instruction's full opcode (with modifiers, e.g. ``QGMMA.64x8x32.F32.E4M3.E4M3``), in order."""
    return [m.group(1) for m in map(_INSN_RE.match, sass.splitlines()) if m]


def count_instructions(sass: str, opcode_prefix: str) -> int:
    """Number of instructions whose opcode starts with ``opcode_prefix`` (``"QGMMA"``, ``"LDL"``...).

    The prefix is matched against the opcode including modifiers, so ``"LDL"`` counts ``LDL.64`` and
    ``"HGMMA.64x128"`` selects one shape; predicates (``@P0``) are ignored.
    """
    return sum(1 for op in opcodes(sass) if op.startswith(opcode_prefix))
