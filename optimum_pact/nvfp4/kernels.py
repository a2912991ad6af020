"""Fast NVFP4 dequantization, bit-exact with `format.dequantize_reference`.

CPU tensors go through a small C kernel (`csrc/dequant.c`) compiled on first use with the system C compiler and
cached in `optimum_pact.cache.cache_dir("kernels")`, keyed by a hash of the source, the compiler, its flags and the
machine. Other devices, `PACT_DISABLE_NATIVE=1`, or a failed build use a pure-torch path: one gather from a
(block scale, packed byte) -> two values table. Both are tested against the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..cache import cache_dir
from .format import BLOCK_SIZE, dequantize_reference, e2m1_table

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "dequant.c"
# -ffp-contract=off: no fused multiply-adds; without -ffast-math denormals are kept, as torch keeps them.
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DENSE_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # csrc/dequant.c's DENSE_BF16, _F16, _F32
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


class _LinearArgs(ctypes.Structure):
    """`pact_linear_t` in csrc/dequant.c: a packed weight (and adapter) bound for the fused product."""

    _fields_ = [
        ("qdata", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("block_scale", ctypes.c_void_p),
        ("q_stride", ctypes.c_int64),
        ("s_stride", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("lora_a", ctypes.c_void_p),
        ("lora_b", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("scale_2", ctypes.c_float),
        ("scaling", ctypes.c_float),
        ("scalar", ctypes.c_int32),
        ("dense", ctypes.c_void_p),
        ("d_stride", ctypes.c_int64),
        ("dense_kind", ctypes.c_int32),
    ]


def _machine_id() -> str:
    """What `-march=native` depends on: architecture plus the CPU model and feature flags where Linux tells them."""
    parts = [platform.system(), platform.machine(), platform.processor()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part"):
                parts.append(line)
                if len(parts) > 6:
                    break
    except OSError:
        pass
    return "\n".join(parts)


def _compile(compiler: str, flags: tuple[str, ...], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, str(_SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} {' '.join(flags)} failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent process sees either no file or a complete one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> ctypes.CDLL:
    """Compile (or reuse a cached build of) the C kernel and load it; raises with the reason on failure.

    A compiler without OpenMP (Apple clang) or `-march=native` gets another try without: one thread / generic code.
    """
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError(f"no C compiler found ({os.environ.get('CC', 'cc')!r} is not on PATH)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    base = b"\0".join([_SOURCE.read_bytes(), compiler.encode(), version.encode(), _machine_id().encode()])
    flag_sets = [_FLAGS, tuple(f for f in _FLAGS if f != "-fopenmp")]
    flag_sets.append(tuple(f for f in flag_sets[1] if f != "-march=native"))
    paths = [
        cache_dir("kernels") / f"nvfp4_dequant_{hashlib.sha256(base + ' '.join(f).encode()).hexdigest()[:24]}.so"
        for f in flag_sets
    ]
    path = next((p for p in paths if p.exists()), None)
    errors = []
    for flags, candidate in zip(flag_sets, paths):
        if path is not None:
            break
        try:
            _compile(compiler, flags, candidate)
            path = candidate
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
    if path is None:
        raise RuntimeError(errors[0])
    if path != paths[0]:
        logger.info("optimum_pact: NVFP4 kernel built with reduced flags (%s): %s", path.name, errors[:1])
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pact_nvfp4_dequantize.argtypes = [ptr, i64, ptr, i64, ctypes.c_float, i64, i64, ptr] + [ctypes.c_int] * 3
    lib.pact_nvfp4_dequantize.restype = ctypes.c_int
    lib.pact_nvfp4_has_avx512.restype = ctypes.c_int
    lib.pact_nvfp4_has_avx2.restype = ctypes.c_int
    lib.pact_nvfp4_linear.argtypes = [ctypes.POINTER(_LinearArgs), ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.pact_nvfp4_linear.restype = ctypes.c_int
    lib.pact_pread_rows.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    lib.pact_pread_rows.restype = i64
    return lib


def _native() -> ctypes.CDLL | None:
    """The loaded kernel, building it on first use; None (after ONE warning) if that is impossible."""
    global _lib, _failed
    if _lib is None and not _failed:
        with _lock:
            if _lib is None and not _failed:
                try:
                    _lib = _build()
                except Exception as exc:  # any failure means the torch path, never a wrong result
                    _failed = True
                    logger.warning("optimum_pact: native NVFP4 dequantizer unavailable, using the torch path: %s", exc)
    return _lib


def native_available() -> bool:
    """Whether CPU dequantization runs the compiled kernel (builds it if needed; False if disabled or it failed)."""
    return os.environ.get("PACT_DISABLE_NATIVE", "") in ("", "0") and _native() is not None


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _loaded() -> ctypes.CDLL:
    """The loaded kernel; a RuntimeError where it cannot be built."""
    lib = _native()
    if lib is None:
        raise RuntimeError("the native NVFP4 kernel is not available")
    return lib


def _native_weight(qdata: torch.Tensor, scale: torch.Tensor) -> tuple[ctypes.CDLL, torch.Tensor, torch.Tensor]:
    """The loaded kernel and the packed weight as it takes it (CPU, rows with a contiguous last dimension), after
    checking the shapes and dtypes; shared by every native entry point."""
    lib = _loaded()
    n, half_k = qdata.shape
    qdata, scale = _last_dim_contiguous(qdata), _last_dim_contiguous(scale)
    if scale.shape != (n, half_k * 2 // BLOCK_SIZE) or half_k % (BLOCK_SIZE // 2):
        raise ValueError(f"NVFP4 shapes do not match: qdata {tuple(qdata.shape)}, scale {tuple(scale.shape)}")
    if not (qdata.is_cpu and scale.is_cpu and qdata.dtype == torch.uint8 and scale.element_size() == 1):
        raise TypeError(f"expected CPU uint8 qdata and e4m3 scale; got {qdata.dtype}, {scale.dtype} on {qdata.device}")
    return lib, qdata, scale


def dequantize_native(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor,
    dtype: torch.dtype,
    scalar: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C kernel on CPU tensors; `scalar=True` forces its portable (non-SIMD) code, for tests. `out`, a contiguous
    CPU tensor of `dtype` and shape [N, K], is written and returned instead of a new tensor."""
    lib, qdata, scale = _native_weight(qdata, scale)
    n, half_k = qdata.shape
    if out is None:
        out = torch.empty(n, half_k * 2, dtype=dtype)
    elif out.shape != (n, half_k * 2) or out.dtype != dtype or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(f"out must be a contiguous CPU {dtype} tensor of shape {(n, half_k * 2)}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")  # fmt: skip
    if out.numel() == 0:
        return out
    status = lib.pact_nvfp4_dequantize(
        qdata.data_ptr(), qdata.stride(0), scale.data_ptr(), scale.stride(0), float(scale_2), n, half_k * 2,
        out.data_ptr(), _DTYPES[dtype], int(scalar), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"native NVFP4 dequantizer rejected its arguments (status {status})")
    return out


class NativeLinear:
    """A packed weight (or a dense one: 16-bit, or an fp32 output head), and optionally one LoRA adapter, bound once
    for the fused product of few rows (decoding).

    Calling it with `x [..., k]` gives `x @ deq(W).T` (+ `scaling * (x @ A.T) @ B.T` with `lora=(A [r, k], B [n, r],
    scaling)`), reading the packed weight directly: no dequantized weight is written. Sums run in fp32 and the result
    is rounded once into x's dtype (fp32, bf16 or fp16). Equals `x.float() @ dequantize_reference(...).T` (plus the
    adapter's term in fp32) up to fp32 rounding order.

    The checks, the adapter's fp32 copies and the kernel's arguments are made here, once: a decode step calls 200+
    layers, so each call only checks x and passes two pointers. The object holds the tensors it points into;
    `lora_versions` are the adapter tensors' versions when bound (a caller that caches it compares them)."""

    def __init__(
        self,
        qdata: torch.Tensor,
        scale: torch.Tensor | None = None,
        scale_2: torch.Tensor | None = None,
        lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
        scalar: bool = False,
    ):
        """`qdata`, `scale`, `scale_2`: a packed weight; or `qdata` a dense weight [n, k] with `scale` and `scale_2`
        None, read as it is: bf16 or fp16 (a layer kept 16-bit; widened to fp32, exact), or fp32 (an output head)."""
        dense = scale is None
        if dense:
            if qdata.dtype not in _DENSE_KINDS or qdata.dim() != 2 or qdata.shape[1] % 16 or not qdata.is_cpu:
                shape = tuple(qdata.shape)
                raise ValueError(
                    f"a dense weight is a CPU bf16 / fp16 / fp32 [n, k] with k a multiple of 16: {qdata.dtype} {shape}"
                )
            self._lib, weight = _loaded(), _last_dim_contiguous(qdata.detach())
            self.n, self.k = weight.shape
        else:
            self._lib, qdata, scale = _native_weight(qdata, scale)
            self.n, self.k = qdata.shape[0], qdata.shape[1] * 2
        a = b = None
        rank, scaling = 0, 1.0
        self.lora_versions = None
        if lora is not None:
            a, b, scaling = lora
            self.lora_versions = (a._version, b._version)
            a, b = a.detach().float().contiguous(), b.detach().float().contiguous()
            rank = a.shape[0]
            if a.shape != (rank, self.k) or b.shape != (self.n, rank):
                raise ValueError(
                    f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a weight of shape {(self.n, self.k)}"
                )
        if dense:  # the dense weight instead of a packed one
            packed, value_2, keep = (None, None, None, 0, 0), 1.0, (weight,)
            dense_args = (weight.data_ptr(), weight.stride(0), _DENSE_KINDS[weight.dtype])
        else:
            # fp32(fp32(e4m3) * scale_2) / 2 for every scale byte: the SIMD path's block factor (it multiplies
            # 2 * E2M1)
            codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
            block_scale = (codes * scale_2.float().reshape(())) * 0.5
            packed = (qdata.data_ptr(), scale.data_ptr(), block_scale.data_ptr(), qdata.stride(0), scale.stride(0))
            value_2, keep, dense_args = float(scale_2), (qdata, scale, block_scale), (None, 0, 0)
        self._keep = (*keep, a, b)  # the memory the arguments point into
        self._args = _LinearArgs(
            *packed, self.n, self.k,
            a.data_ptr() if a is not None else None, b.data_ptr() if b is not None else None, rank,
            value_2, float(scaling), int(scalar), *dense_args,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.k:
            raise ValueError(f"x of shape {tuple(x.shape)} does not fit an NVFP4 weight of shape {(self.n, self.k)}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"x must be fp32, bf16 or fp16, not {x.dtype}")
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """`__call__` without its checks, for a caller that has made them (x: CPU, [..., k], fp32 / bf16 / fp16),
        giving [..., n]: the leading dimensions are kept, so a decoding step's [1, 1, k] needs no reshape (each
        costs about as much as the checks)."""
        x = x.contiguous()  # read through its pointer: no autograd here
        out = torch.empty(*x.shape[:-1], self.n, dtype=x.dtype)  # ints: a torch.Size argument took 3-5 us more
        if out.numel() == 0:
            return out
        status = self._lib.pact_nvfp4_linear(
            self._args, x.data_ptr(), x.numel() // self.k, out.data_ptr(), _DTYPES[x.dtype], torch.get_num_threads()
        )
        if status != 0:
            raise RuntimeError(f"native NVFP4 linear rejected its arguments (status {status})")
        return out


def linear_native(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor,
    x: torch.Tensor,
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    scalar: bool = False,
) -> torch.Tensor:
    """`x [m, k] @ deq(W).T` for a few rows in one call (see `NativeLinear`, which binds the weight for many)."""
    return NativeLinear(qdata, scale, scale_2, lora, scalar)(x)


def dequantize_torch(
    qdata: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Pure torch, any device: one gather per packed byte from a [256 scales x 256 bytes] table of value pairs.

    Each entry is `fp32(fp32(E2M1 * scale) * scale_2)` cast to `dtype`, the very operations of the reference,
    so the gather is bit-exact. A pair of values is gathered as one int32 / int64 (`index_select` on a flat
    table is several times faster than `embedding` on CPU); the table is rebuilt per call (scale_2 changes).
    """
    n, half_k = qdata.shape
    device = qdata.device
    codes = torch.arange(256, device=device)
    scales = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()  # NaN entries exist but are never indexed
    pairs = e2m1_table(device=device)[torch.stack((codes & 0x0F, codes >> 4), dim=-1)]  # [byte, 2]
    table = ((pairs * scales[:, None, None]) * scale_2.float().reshape(())).to(dtype)  # [scale, byte, 2]
    pair_dtype = {1: torch.int16, 2: torch.int32, 4: torch.int64}[table.element_size()]
    index = qdata.reshape(n, half_k // 8, BLOCK_SIZE // 2).int()
    index.add_((scale.view(torch.uint8).int() << 8).unsqueeze(-1))
    out = table.view(pair_dtype).reshape(-1).index_select(0, index.reshape(-1))
    return out.view(dtype).reshape(n, half_k * 2)


def dequantize(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 uint8 [N, K/2] + e4m3 [N, K/16] + fp32 scalar -> contiguous `dtype` [N, K], equal to the reference.
    The native kernel writes into `out` where given (a caller's reused buffer); the other paths return a new
    tensor and leave `out` alone, so use the returned tensor."""
    if dtype not in _DTYPES:  # e.g. float64: no fast path needed
        return dequantize_reference(qdata, scale, scale_2, dtype)
    if qdata.is_cpu and native_available():
        return dequantize_native(qdata, scale, scale_2, dtype, out=out)
    return dequantize_torch(qdata, scale, scale_2, dtype)


def pread_rows(fd: int, base: int, rows: torch.Tensor, out: torch.Tensor) -> int:
    """Read `out[i] = file[base + rows[i] * row_bytes : + row_bytes]` (row_bytes: one row of `out`, a contiguous CPU
    tensor) from the open file `fd` with pread, not through any mapping; returns the rows read in full (fewer: the
    file is shorter). The C kernel when built, else a Python loop (~4 us a row)."""
    rows = rows.to(torch.int64).contiguous()
    row_bytes = out[0].numel() * out.element_size() if len(out) else 0
    lib = _native() if native_available() else None
    if lib is not None:
        return int(lib.pact_pread_rows(fd, rows.data_ptr(), len(rows), row_bytes, base, out.data_ptr()))
    view = memoryview(out.view(torch.uint8).numpy()).cast("B") if len(out) else memoryview(b"")
    for i, row in enumerate(rows.tolist()):
        at = i * row_bytes
        if os.preadv(fd, [view[at : at + row_bytes]], base + row * row_bytes) != row_bytes:
            return i
    return len(rows)
