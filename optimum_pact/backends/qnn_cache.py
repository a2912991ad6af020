"""On-disk cache of compiled QNN graphs (EPContext models holding the HTP context binary) for the qnn backend.

Compiling a graph for the HTP takes ~0.1 s on the x86_64 emulator and seconds on a phone; loading its context binary
takes milliseconds. An entry is keyed by everything that determines the compiled graph: the ONNX model bytes (product,
shapes, fp16 precision, the dequantizer), soc_model, the QNN EP options, the onnxruntime and onnxruntime-qnn versions
and `CACHE_FORMAT`. Any change gives a new key, so a stale entry is never looked up.

Each entry is `<graph>_soc<id>_<key>_ctx.onnx` plus a `.sha256` sidecar with its content hash, both written to a
temporary name and renamed into place. An entry whose hash does not match, that does not load, or whose inputs and
outputs differ from the graph it stands for is corrupted: it is deleted and rebuilt, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..cache import cache_dir as pact_cache_dir

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when what a cached graph means changes in a way the ONNX bytes do not show


def default_cache_dir() -> Path:
    """`$PACT_CACHE/qnn` (default `~/.cache/optimum_pact/qnn`)."""
    return pact_cache_dir("qnn")


def cache_key(model_bytes: bytes, soc_model: str, provider_options: Mapping[str, str]) -> str:
    import onnxruntime
    import onnxruntime_qnn

    payload = {
        "format": CACHE_FORMAT,
        "model": hashlib.sha256(model_bytes).hexdigest(),
        "soc_model": soc_model,
        "provider_options": sorted(provider_options.items()),
        "onnxruntime": onnxruntime.__version__,
        "onnxruntime_qnn": onnxruntime_qnn.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def entry_paths(cache_dir: Path, model, soc_model: str, key: str) -> tuple[Path, Path]:
    """The context model and its checksum sidecar for one graph."""
    ctx = Path(cache_dir) / f"{model.graph.name}_soc{soc_model}_{key}_ctx.onnx"
    return ctx, ctx.with_name(ctx.name + ".sha256")


def _signature(items) -> list[tuple[str, list, str]]:
    return [(i.name, list(i.shape), i.type) for i in items]


def _expected_signature(model) -> tuple[list, list]:
    from onnx import TensorProto

    names = {TensorProto.FLOAT16: "float16", TensorProto.UINT8: "uint8", TensorProto.FLOAT: "float"}

    def describe(values):
        out = []
        for v in values:
            tensor = v.type.tensor_type
            out.append((v.name, [d.dim_value for d in tensor.shape.dim], f"tensor({names[tensor.elem_type]})"))
        return out

    return describe(model.graph.input), describe(model.graph.output)


def cached_session(model, soc_model: str, provider_options: Mapping[str, str], cache_dir: Path, make_session) -> Any:
    """A session for `model`, loaded from the cache when a sound entry exists, else compiled and stored."""
    data = model.SerializeToString()
    ctx, digest_file = entry_paths(cache_dir, model, soc_model, cache_key(data, soc_model, provider_options))
    if ctx.exists() or digest_file.exists():
        try:
            blob = ctx.read_bytes()
            expected = digest_file.read_text().strip() if digest_file.is_file() else "<missing>"
            if hashlib.sha256(blob).hexdigest() != expected:
                raise ValueError("its sha256 does not match the recorded one")
            session = make_session(blob, soc_model, provider_options)
            if (_signature(session.get_inputs()), _signature(session.get_outputs())) != _expected_signature(model):
                raise ValueError("its inputs and outputs differ from the graph it stands for")
            return session
        except Exception as err:
            logger.warning("optimum-pact: cached QNN graph %s is corrupted (%s); rebuilding it.", ctx, err)
            for path in (ctx, digest_file):
                path.unlink(missing_ok=True)
    try:
        ctx.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        logger.warning("optimum-pact: cannot create the QNN graph cache %s (%s); compiling uncached.", ctx.parent, err)
        return make_session(data, soc_model, provider_options)
    tmp = ctx.with_name(f".{ctx.stem}.{os.getpid()}.{threading.get_ident()}.tmp.onnx")
    digest_tmp = tmp.with_name(tmp.name + ".sha256")
    config = {"ep.context_enable": "1", "ep.context_file_path": str(tmp), "ep.context_embed_mode": "1"}
    try:
        try:
            session = make_session(data, soc_model, provider_options, config=config)
        except Exception:  # writing the context failed, or the graph does not compile: the retry tells which
            return make_session(data, soc_model, provider_options)
        try:
            blob = tmp.read_bytes()
            digest_tmp.write_text(hashlib.sha256(blob).hexdigest() + "\n")
            os.replace(digest_tmp, digest_file)
            os.replace(tmp, ctx)
        except OSError as err:
            logger.warning("optimum-pact: could not store the compiled QNN graph in %s (%s).", ctx.parent, err)
        return session
    finally:
        tmp.unlink(missing_ok=True)
        digest_tmp.unlink(missing_ok=True)
