"""The qnn backend: both frozen-weight products as ONNX graphs on a Qualcomm Hexagon NPU (ONNX Runtime's QNN EP, HTP).

Each product is one ONNX graph whose weight-side inputs are the packed NVFP4 tensors themselves:

* `packed` uint8 [N, K/2] (the layer's `weight` buffer) -> Cast int32 -> Gather from a 256 x 2 fp16 *pair table*
  (row b = [E2M1[b & 15], E2M1[b >> 4]], element 2i in the low nibble) -> Reshape [N, K/16, 16];
* `scale_bytes` uint8 [N, K/16] (the e4m3 `weight_scale` buffer, viewed as bytes) -> Cast int32 -> Gather from the
  layer's 256-entry fp16 `scale_table` (`fp16(fp32(e4m3[b]) * scale_2 * 2**weight_exp)`) -> Reshape [N, K/16, 1];
* Mul -> Reshape [N, K] = the dequantized weight, a transient inside the graph.

The forward graph ends in `Gemm(x, W, transB=1)` (QNN FullyConnected, which takes the [N, K] weight as it is); the
input-gradient graph ends in `MatMul(dy, W)`. Both use the same dequantizer subgraph (`_dequantizer`), neither
holds a transposed weight. The weight tensors are graph INPUTS, never initializers: ONNX Runtime constant-folds a
subgraph whose inputs are all initializers before the EP sees it, which would hand QNN a dequantized fp16 weight.

Residency: `prepare` wraps the module's own packed buffers as OrtValues (no copy) and binds them once into an
IOBinding per compiled graph; a call binds only the activation and the output. Per layer, the only extra memory is
the 512-byte scale table.

Numerics: the graphs compute in fp16 on the HTP (HTP runs fp32 graphs at fp16 precision anyway). Inputs and weight
are normalised by powers of two so that fp16 never over- or underflows on them: the weight is stored scaled by
`2**weight_exp` (largest |w| in [1, 2)) and each activation (or gradient) row goes through the per-row range guard
(`optimum_pact.precision.range_guard`): divided by `2**floor(log2(row amax))`, and further where the row's L1 norm
could overflow an fp16 output (a *guarded* row, counted in `counts["guarded_rows"]`). The output is scaled back in
fp32, exactly. Results come back in the input's dtype. A layer kept 16-bit by the precision plan is bound as one
fp16 weight input instead of the dequantizer (`weight_format="fp16"`).

Shapes: QNN HTP needs static shapes (a dynamic token dimension leaves MatMul unsupported), so the token dimension
is padded with zeros to a power-of-two bucket (at least `min_tokens`); more than `max_tokens` tokens are run in
chunks. A backend instance compiles one session per (product, N, K, bucket, weight format) and shares it with every
layer holding that instance (a model holds one): a fine-tune compiles a handful of graphs, not one per layer.

Compiled graphs are cached on disk as QNN context binaries (`qnn_cache`; `cache=False` turns it off).

No silent fallback: every session sets `session.disable_cpu_ep_fallback=1`, so a node QNN cannot take is an error,
and records node placement (`QnnBackend.graph_placement()`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..nvfp4 import BLOCK_SIZE, E2M1_VALUES, NVFP4Tensor
from ..precision.range_guard import row_exponents, scale_rows, unscale_rows
from .base import BackendUnavailableError
from .qnn_cache import cached_session, default_cache_dir

logger = logging.getLogger(__name__)

EP_NAME = "QNNExecutionProvider"
INSTALL_HINT = "pip install optimum-pact[qnn]"
DEFAULT_SOC_MODEL = "60"
OPSET = 21
PRODUCTS = ("forward", "input_grad")
WEIGHT_FORMATS = ("nvfp4", "fp16")
# Activation input and output names of each product graph; the weight-side inputs are shared.
_IO_NAMES = {"forward": ("x", "y"), "input_grad": ("dy", "dx")}
WEIGHT_INPUTS = ("packed", "scale_bytes", "scale_table")
# Keys the backend sets itself; `provider_options` may not override them.
_RESERVED_OPTIONS = ("backend_type", "soc_model")


_REQUIRED = ("onnx", "onnxruntime", "onnxruntime_qnn")


@functools.cache
def is_qnn_available() -> bool:
    """Whether onnx, onnxruntime and onnxruntime-qnn are installed (imports none of them)."""
    return all(importlib.util.find_spec(name) is not None for name in _REQUIRED)


def _require_qnn() -> None:
    if not is_qnn_available():
        raise BackendUnavailableError(
            "backend='qnn' needs the packages onnx, onnxruntime and onnxruntime-qnn, which are not all installed. "
            f"Install them with `{INSTALL_HINT}`, or use backend='torch'."
        )


_register_lock = threading.Lock()


def _qnn_devices() -> tuple:
    """The QNN EP's devices, registering the EP library with ONNX Runtime on first use."""
    _require_qnn()
    import onnxruntime as ort
    import onnxruntime_qnn

    with _register_lock:
        devices = tuple(d for d in ort.get_ep_devices() if d.ep_name == EP_NAME)
        if not devices:
            try:
                ort.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
            except Exception as err:
                raise BackendUnavailableError(
                    f"backend='qnn' could not load the QNN execution provider ({err}). "
                    f"Install onnxruntime-qnn for this platform with `{INSTALL_HINT}`, or use backend='torch'."
                ) from err
            devices = tuple(d for d in ort.get_ep_devices() if d.ep_name == EP_NAME)
    if not devices:
        raise BackendUnavailableError(
            f"backend='qnn': the QNN execution provider registered but reports no device. "
            f"Reinstall it with `{INSTALL_HINT}`, or use backend='torch'."
        )
    return devices


def _pair_table():
    import numpy as np

    b = np.arange(256)
    e2m1 = np.asarray(E2M1_VALUES, dtype=np.float32)
    return np.stack((e2m1[b & 0x0F], e2m1[b >> 4]), axis=-1).astype(np.float16)


def _dequantizer(n: int, k: int) -> tuple[list, list]:
    """Nodes and initializers that turn the weight-side inputs into `weight` fp16 [n, k]; shared by both products."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Cast", ["packed"], ["codes"], to=TensorProto.INT32),
        helper.make_node("Gather", ["pair_table", "codes"], ["pairs"], axis=0),  # [n, k/2, 2]
        helper.make_node("Reshape", ["pairs", "block_shape"], ["blocks"]),  # [n, k/16, 16]
        helper.make_node("Cast", ["scale_bytes"], ["scale_codes"], to=TensorProto.INT32),
        helper.make_node("Gather", ["scale_table", "scale_codes"], ["scales"], axis=0),  # [n, k/16]
        helper.make_node("Reshape", ["scales", "scale_shape"], ["block_scales"]),  # [n, k/16, 1]
        helper.make_node("Mul", ["blocks", "block_scales"], ["scaled_blocks"]),
        helper.make_node("Reshape", ["scaled_blocks", "weight_shape"], ["weight"]),  # [n, k]
    ]
    initializers = [
        numpy_helper.from_array(_pair_table(), "pair_table"),
        numpy_helper.from_array(np.array([n, k // BLOCK_SIZE, BLOCK_SIZE], np.int64), "block_shape"),
        numpy_helper.from_array(np.array([n, k // BLOCK_SIZE, 1], np.int64), "scale_shape"),
        numpy_helper.from_array(np.array([n, k], np.int64), "weight_shape"),
    ]
    return nodes, initializers


def build_product_graph(product: str, n: int, k: int, tokens: int, weight_format: str = "nvfp4"):
    """The ONNX model of one frozen product for a weight [n, k] and `tokens` rows of activations (static shapes).

    `product="forward"`: y [tokens, n] = x [tokens, k] @ deq(W).T (Gemm transB=1); `"input_grad"`:
    dx [tokens, k] = dy [tokens, n] @ deq(W) (MatMul). Everything is fp16 except the uint8 weight inputs.
    `weight_format="fp16"` takes the weight as one fp16 input [n, k] instead of the NVFP4 dequantizer.
    """
    if product not in PRODUCTS:
        raise ValueError(f"product={product!r} is not one of {PRODUCTS}.")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r} is not one of {WEIGHT_FORMATS}.")
    import onnx
    from onnx import TensorProto, helper

    nodes, initializers = _dequantizer(n, k) if weight_format == "nvfp4" else ([], [])
    a, out = _IO_NAMES[product]
    if product == "forward":
        nodes.append(helper.make_node("Gemm", [a, "weight"], [out], transB=1))
        width_in, width_out = k, n
    else:
        nodes.append(helper.make_node("MatMul", [a, "weight"], [out]))
        width_in, width_out = n, k
    fp16, u8 = TensorProto.FLOAT16, TensorProto.UINT8
    inputs = [helper.make_tensor_value_info(a, fp16, [tokens, width_in])]
    if weight_format == "nvfp4":
        inputs += [
            helper.make_tensor_value_info("packed", u8, [n, k // 2]),
            helper.make_tensor_value_info("scale_bytes", u8, [n, k // BLOCK_SIZE]),
            helper.make_tensor_value_info("scale_table", fp16, [256]),
        ]
    else:
        inputs.append(helper.make_tensor_value_info("weight", fp16, [n, k]))
    outputs = [helper.make_tensor_value_info(out, fp16, [tokens, width_out])]
    name = f"pact_{product}_{n}x{k}_t{tokens}" + ("" if weight_format == "nvfp4" else f"_{weight_format}")
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="optimum-pact")
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def make_session(
    model, soc_model: str, provider_options: Mapping[str, str] | None = None, config: Mapping[str, str] | None = None
):
    """An InferenceSession on the QNN HTP backend only: CPU fallback disabled, node placement recorded.

    `model` is an ONNX ModelProto or its bytes; `config` adds session config entries (e.g. `ep.context_*`).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # the EP warns about desktop-only features on every session
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    options.add_provider_for_devices(
        list(_qnn_devices()), {**(provider_options or {}), "backend_type": "htp", "soc_model": soc_model}
    )
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, options)


def _check_soc_model(soc_model: str | int) -> str:
    if isinstance(soc_model, bool) or not isinstance(soc_model, (str, int)) or not str(soc_model).isdigit():
        raise ValueError(
            f"QnnBackend soc_model={soc_model!r} is invalid; pass the Snapdragon SoC id of the target as a number, "
            f"e.g. soc_model='{DEFAULT_SOC_MODEL}' (the default)."
        )
    return str(int(soc_model))


def _start_htp(soc_model: str) -> None:
    """Start the HTP backend (a 16 x 16 forward graph), turning failures into clear errors."""
    try:
        make_session(build_product_graph("forward", 16, 16, 16), soc_model)
    except BackendUnavailableError:
        raise
    except Exception as err:
        if soc_model != DEFAULT_SOC_MODEL:
            try:
                _start_htp(DEFAULT_SOC_MODEL)
            except BackendUnavailableError:
                pass
            else:
                raise ValueError(
                    f"QnnBackend soc_model={soc_model!r} is not supported by this QNN HTP backend (ONNX Runtime: "
                    f"{err}). Set soc_model to the id of a supported Snapdragon SoC, e.g. '{DEFAULT_SOC_MODEL}'."
                ) from None
        raise BackendUnavailableError(
            f"backend='qnn' could not start the QNN HTP backend with soc_model={soc_model!r} ({err}). "
            f"Check the onnxruntime-qnn install (`{INSTALL_HINT}`), or use backend='torch'."
        ) from err


@dataclass
class QnnWeight:
    """The handle of one frozen weight: its packed buffers as OrtValues, bound once per compiled graph."""

    shape: tuple[int, int]
    weight_exp: int  # the stored weight is deq(W) * 2**weight_exp
    tensors: tuple[torch.Tensor, ...]  # nvfp4: packed, scale bytes, scale table; fp16: the weight (aliased by values)
    values: dict[str, Any]  # input name -> OrtValue
    absmax: float  # the largest |value| of the stored weight as the graph sees it (for the range guard)
    format: str = "nvfp4"
    bindings: dict[tuple[str, int], Any] = field(default_factory=dict)  # (product, bucket) -> IOBinding


class QnnBackend:
    """Frozen-weight products on a Qualcomm Hexagon NPU through ONNX Runtime's QNN execution provider (HTP).

    Args:
        soc_model: the Snapdragon SoC id the graphs are compiled for (QNN's `soc_model`), default "60".
        min_tokens: the smallest token bucket (a power of two); every call is padded to a power-of-two bucket.
        max_tokens: the largest bucket (a power of two); longer inputs run in chunks of this many tokens.
        provider_options: extra QNN EP options (strings), e.g. {"htp_performance_mode": "burst"}.
        cache: keep compiled graphs (QNN context binaries) on disk and load them instead of compiling again.
        cache_dir: where; default `$PACT_CACHE/qnn` (`~/.cache/optimum_pact/qnn`). See `qnn_cache`.

    Building one starts the HTP once (a small probe graph), so a backend that does not start fails here, with the
    fix in its message. The compiled graphs belong to this instance and serve every layer that holds it.
    The whole weight is dequantized inside the graph: there is no `tile_size`.
    """

    name = "qnn"
    requested, reason = "qnn", "requested"  # built directly; `get_backend` sets both on the instance
    runs_beside_cpu = True  # the products run on the NPU while the CPU computes the adapter path

    def __init__(
        self,
        soc_model: str | int = DEFAULT_SOC_MODEL,
        min_tokens: int = 16,
        max_tokens: int = 4096,
        provider_options: Mapping[str, str] | None = None,
        cache: bool = True,
        cache_dir: str | os.PathLike | None = None,
    ):
        for label, value in (("min_tokens", min_tokens), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(f"QnnBackend {label}={value!r} must be a positive power of two, e.g. 16 or 4096.")
        if min_tokens > max_tokens:
            raise ValueError(f"QnnBackend min_tokens={min_tokens} exceeds max_tokens={max_tokens}; lower min_tokens.")
        options = dict(provider_options or {})
        bad = [key for key in options if key in _RESERVED_OPTIONS or not isinstance(options[key], str)]
        if bad:
            raise ValueError(
                f"QnnBackend provider_options has invalid entries {bad}: values must be strings, and "
                f"{', '.join(_RESERVED_OPTIONS)} are set by the backend (use soc_model=...)."
            )
        self.soc_model = _check_soc_model(soc_model)
        _require_qnn()
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.provider_options = options
        if not isinstance(cache, bool):
            raise ValueError(f"QnnBackend cache={cache!r} must be True or False.")
        if cache_dir is not None and not cache:
            raise ValueError(f"QnnBackend cache_dir={cache_dir!r} is set but cache=False; drop one of them.")
        self.cache_dir: Path | None = None
        if cache:
            self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.counts: Counter[str] = Counter()  # products run (`forward`, `input_grad`) and `guarded_rows`
        _start_htp(self.soc_model)
        self._runtime = _Runtime(self.soc_model, options, self.cache_dir)

    def dense_weight_dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        """Always fp16: the NPU computes in fp16, whatever the source dtype."""
        return torch.float16

    def bucket(self, tokens: int) -> int:
        """The padded token count a call with `tokens` rows (at most `max_tokens`) runs at."""
        return max(self.min_tokens, 1 << max(tokens - 1, 0).bit_length())

    def prepare(self, weight: NVFP4Tensor | torch.Tensor) -> QnnWeight:
        from onnxruntime import OrtValue

        if isinstance(weight, torch.Tensor):  # a 16-bit layer: bound as it is when it is fp16 (no copy)
            dense = weight.detach().cpu().to(torch.float16).contiguous()
            value = OrtValue.ortvalue_from_numpy(dense.numpy())
            return QnnWeight(tuple(dense.shape), 0, (dense,), {"weight": value}, float(dense.abs().amax()), "fp16")
        n, k = weight.shape
        if k % BLOCK_SIZE:
            raise ValueError(f"NVFP4 weight of shape {(n, k)} has in_features not a multiple of {BLOCK_SIZE}.")
        packed = weight.qdata.detach().cpu().contiguous()
        scale_bytes = weight.scale.detach().cpu().contiguous().view(torch.uint8)
        scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
        combined = scales * weight.scale_2.detach().cpu().float().reshape(())  # fp32(e4m3) * scale_2, as reference
        largest = weight.absmax()  # the largest |deq(W)| (E2M1 magnitudes are at most 6)
        # stored weight = deq(W) * 2**weight_exp with its largest |value| in [1, 2): fp16 cannot overflow, and only
        # blocks 2**14 below the largest one fall into fp16 subnormals (E4M3 spans 2**18, so none underflow to 0)
        weight_exp = 0 if not math.isfinite(largest) or largest == 0 else -math.floor(math.log2(largest))
        table = (combined * 2.0**weight_exp).to(torch.float16)  # exact power-of-two shift, then ONE rounding
        tensors = (packed, scale_bytes, table)
        values = {name: OrtValue.ortvalue_from_numpy(t.numpy()) for name, t in zip(WEIGHT_INPUTS, tensors)}
        absmax = largest * 2.0**weight_exp if math.isfinite(largest) else 0.0
        return QnnWeight((n, k), weight_exp, tensors, values, absmax)

    def forward(self, x: torch.Tensor, handle: QnnWeight) -> torch.Tensor:
        return self._run("forward", x, handle)

    def input_grad(self, dy: torch.Tensor, handle: QnnWeight) -> torch.Tensor:
        return self._run("input_grad", dy, handle)

    def graph_placement(self) -> dict[tuple[str, int, int, int, str], dict[str, list[str]]]:
        """For each compiled graph (product, N, K, bucket, weight format): execution provider -> its op types.

        A graph loaded from the cache is one `EPContext` node (the compiled QNN context) on the QNN EP.
        """
        return self._runtime.placement()

    def _run(self, product: str, a: torch.Tensor, handle: QnnWeight) -> torch.Tensor:
        n, k = handle.shape
        width_in, width_out = (k, n) if product == "forward" else (n, k)
        if a.shape[-1] != width_in:
            raise ValueError(
                f"qnn {product}: the input's last dimension is {a.shape[-1]}, but the weight {n}x{k} needs {width_in}."
            )
        self.counts[product] += 1
        lead = a.shape[:-1]
        flat = a.detach().reshape(-1, width_in).float().cpu()  # once: the guard and the staging both read fp32
        tokens = flat.shape[0]
        out = torch.empty(tokens, width_out, dtype=a.dtype, device=a.device)
        if tokens == 0:
            return out.reshape(*lead, width_out)
        # the range guard: each row runs scaled by its own power of two (largest |value| in [1, 2), or lower where
        # the row's L1 norm could overflow an fp16 output), scaled back exactly in fp32
        exp, guarded = row_exponents(flat, handle.absmax, normalize=True)
        self.counts["guarded_rows"] += guarded
        for t0 in range(0, tokens, self.max_tokens):
            rows = slice(t0, min(t0 + self.max_tokens, tokens))
            count = rows.stop - rows.start
            bucket = self.bucket(count)
            staged = torch.zeros(bucket, width_in, dtype=torch.float16)
            staged[:count] = scale_rows(flat[rows], exp[rows])  # out of place: never scale the caller's x
            result = torch.empty(bucket, width_out, dtype=torch.float16)
            self._runtime.run(product, handle, staged, result)
            out[rows] = unscale_rows(result[:count], exp[rows], -handle.weight_exp).to(out.device, out.dtype)
        return out.reshape(*lead, width_out)


class _Runtime:
    """The compiled graphs of one QnnBackend instance, shared by every layer that holds it."""

    def __init__(self, soc_model: str, provider_options: dict[str, str], cache_dir: Path | None):
        self.soc_model, self.provider_options, self.cache_dir = soc_model, provider_options, cache_dir
        self.sessions: dict[tuple[str, int, int, int, str], Any] = {}
        self._lock = threading.Lock()

    def session(self, product: str, n: int, k: int, bucket: int, weight_format: str = "nvfp4"):
        key = (product, n, k, bucket, weight_format)
        session = self.sessions.get(key)
        if session is None:
            with self._lock:
                session = self.sessions.get(key)
                if session is None:
                    model = build_product_graph(product, n, k, bucket, weight_format)
                    if self.cache_dir is None:
                        session = make_session(model, self.soc_model, self.provider_options)
                    else:
                        args = (model, self.soc_model, self.provider_options, self.cache_dir, make_session)
                        session = cached_session(*args)
                    self.sessions[key] = session
        return session

    def run(self, product: str, handle: QnnWeight, staged: torch.Tensor, result: torch.Tensor) -> None:
        import numpy as np

        n, k = handle.shape
        bucket = staged.shape[0]
        session = self.session(product, n, k, bucket, handle.format)
        binding = handle.bindings.get((product, bucket))
        if binding is None:
            binding = session.io_binding()
            for name, value in handle.values.items():
                binding.bind_ortvalue_input(name, value)  # the resident weight: bound once
            handle.bindings[(product, bucket)] = binding
        a, out = _IO_NAMES[product]
        binding.bind_input(a, "cpu", 0, np.float16, tuple(staged.shape), staged.data_ptr())
        binding.bind_output(out, "cpu", 0, np.float16, tuple(result.shape), result.data_ptr())
        session.run_with_iobinding(binding)

    def placement(self) -> dict[tuple[str, int, int, int, str], dict[str, list[str]]]:
        report = {}
        for key, session in list(self.sessions.items()):
            placed: dict[str, list[str]] = {}
            for info in session.get_provider_graph_assignment_info():
                placed.setdefault(info.ep_name, []).extend(node.op_type for node in info.get_nodes())
            report[key] = placed
        return report


__all__ = ["QnnBackend", "QnnWeight", "build_product_graph", "is_qnn_available", "make_session"]
