"""Frozen weights kept memory-mapped from a file instead of in anonymous memory.

`map_frozen_weights` writes the frozen tensors of a model (the packed NVFP4 weights and scales of every
`FrozenLinear`, the embedding and output head, any other frozen parameter or buffer of at least `min_bytes`) to one
file, maps it back read-only-in-practice (`torch.load(mmap=True)`: a private, copy-on-write mapping) and puts the
mapped tensors in the model's place; the file is unlinked at once, so nothing is left on disk after the process
ends, yet the pages stay backed by it. Values are bit for bit the same.

Why: a mapped weight's pages are page cache, not process-private memory. The kernel reads in only what a step
touches (the embedding rows of the batch, the NVFP4 blocks being multiplied) and may drop clean pages under memory
pressure and read them again later, so the weights stop competing with activations for the memory a background job
may hold. They still show in the resident size (RssFile, and so VmHWM) while touched; `LiveTensorTracker` counts
them as `mapped_bytes`, apart from live tensors. Trainable parameters (LoRA) are never mapped.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import weakref
from pathlib import Path

import torch
from torch import nn

from ..dataflow import FrozenLinear
from ..nvfp4 import NVFP4Tensor
from ..pages import release_clean_pages

MIN_BYTES = 2**20  # smaller tensors (norms, biases) cost a few pages: not worth a mapping


def map_frozen_weights(model: nn.Module, folder: str | os.PathLike | None = None, min_bytes: int = MIN_BYTES) -> dict:
    """Replace every frozen parameter / buffer of at least `min_bytes` by a memory-mapped copy.

    Returns `{"mapped": [tensor, ...], "names": [...], "bytes": total, "file": WeightsFile}`, each tensor once (tied
    weights stay tied); the `WeightsFile` is for `WeightStream`.
    The file goes in `folder` (default: the system temp dir) and needs as much free space as the mapped bytes.
    Call it once: a second call maps the mapped tensors again, into a new file. The file is checked as it is mapped
    back: if it is truncated or corrupt, or a tensor is missing or has another dtype or shape than was written, a
    ValueError names the file and each such tensor, and the model is left as it was.
    """
    owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}  # id(tensor) -> [(module, attribute, is_param)]
    tensors: dict[int, tuple[str, torch.Tensor]] = {}
    for module_name, module in model.named_modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is None or (is_param and t.requires_grad) or t.device.type != "cpu":
                    continue
                if t.numel() * t.element_size() < min_bytes and not isinstance(module, FrozenLinear):
                    continue
                owners.setdefault(id(t), []).append((module, name, is_param))
                tensors.setdefault(id(t), (f"{module_name}.{name}".lstrip("."), t))
    if not tensors:
        return {"mapped": [], "names": [], "bytes": 0, "file": None}
    root = Path(folder if folder is not None else tempfile.gettempdir()).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="pact-weights-", suffix=".pt", dir=root)
    os.close(fd)
    try:
        torch.save({name: t.detach().contiguous() for name, t in tensors.values()}, path)
        loaded = _read_back(path, {name: (t.dtype, t.shape) for name, t in tensors.values()})
        weights_file = WeightsFile(path)
    finally:
        os.unlink(path)  # the mapping (and the descriptor kept) keep the inode alive; nothing is left behind
    frozen_linears = set()
    for key, places in owners.items():
        mapped = loaded[tensors[key][0]]
        if places[0][2]:
            mapped = nn.Parameter(mapped, requires_grad=False)
        for module, name, is_param in places:
            (module._parameters if is_param else module._buffers)[name] = mapped
            if isinstance(module, FrozenLinear):
                frozen_linears.add(module)
    for layer in frozen_linears:  # the backend prepares its handle again from the mapped buffers
        if layer.precision == "nvfp4":
            layer.load_nvfp4(NVFP4Tensor(layer.weight, layer.weight_scale, layer.weight_scale_2))
        else:
            layer.release_handle()
    for _, original in tensors.values():  # a base read memory-mapped (the packed cache): its touched pages would
        release_clean_pages(original)  # stay resident beside the copy's, two copies of the weights counted
    mapped = [loaded[tensors[key][0]] for key in owners]
    return {
        "mapped": mapped,
        "names": [tensors[key][0] for key in owners],
        "bytes": sum(t.numel() * t.element_size() for t in mapped),
        "file": weights_file,
    }


class WeightsFileError(RuntimeError):
    """The weights file under a mapping lost bytes while the mapping was in use."""


class WeightsFile:
    """The (unlinked) file `map_frozen_weights` mapped, held open so that its size can be checked before pages are
    read back from it: `check()` raises `WeightsFileError` where reading would raise SIGBUS."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        stat = os.fstat(self.fd)
        self.size, self.device, self.inode = stat.st_size, stat.st_dev, stat.st_ino
        self._finalizer = weakref.finalize(self, os.close, self.fd)

    def check(self) -> None:
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise WeightsFileError(
                f"The frozen-weights file {self.path} (unlinked when it was mapped, still open as /proc/{os.getpid()}"
                f"/fd/{self.fd}) was cut from {self.size} to {size} bytes while training ran: the frozen weights can "
                "no longer be read back from it. Nothing of this step was saved; the last checkpoint is intact. "
                "Find what truncates files of this process (a cleaner with access to /proc), then start the job "
                "again, resuming from that checkpoint: the weights are written anew."
            )

    def close(self) -> None:
        self._finalizer()


def _read_back(path: str, written: dict[str, tuple[torch.dtype, torch.Size]]) -> dict[str, torch.Tensor]:
    """Map the file `path` that was just written with the tensors `written` describes (name -> (dtype, shape)); check
    that it holds each of them, with its dtype and shape, before anything is put in the model (values are not read:
    that would page in the whole file)."""
    fix = (
        f"Nothing was mapped and the model is unchanged. Check the free space and the file system under "
        f"{os.path.dirname(path)}, or pass map_frozen_weights another folder."
    )
    try:
        loaded = torch.load(path, mmap=True, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise ValueError(
            f"map_frozen_weights could not read back the weights file {path} it had just written: it is truncated "
            f"or corrupt ({type(err).__name__}: {err}). {fix}"
        ) from err
    if not isinstance(loaded, dict):
        raise ValueError(
            f"map_frozen_weights read back a {type(loaded).__name__} from the weights file {path}, not the dict of "
            f"tensors it had written: the file was changed after it was written. {fix}"
        )
    problems = []
    for name, (dtype, shape) in written.items():
        got = loaded.get(name)
        if not isinstance(got, torch.Tensor):
            problems.append(f"{name}: missing from the weights file")
        elif got.dtype != dtype:
            problems.append(f"{name}: dtype {got.dtype}, must be {dtype}")
        elif got.shape != shape:
            problems.append(f"{name}: shape {list(got.shape)}, must be {list(shape)}")
    problems += [f"{name}: unexpected in the weights file" for name in loaded.keys() - written.keys()]
    if problems:
        raise ValueError(
            f"map_frozen_weights read back the weights file {path} with tensors missing or changed since it was "
            "written (another process, or a faulty disk):\n  - " + "\n  - ".join(problems) + f"\n{fix}"
        )
    return loaded
