"""Live-tensor memory accounting: the peak of bytes held by tensor storages, on real or fake tensors alike.

`LiveTensorTracker` is a `TorchDispatchMode`: every tensor an operator returns (forward, recomputation and backward
alike; autograd carries the mode into backward) has its storage registered once, and a weak reference on the
storage subtracts its bytes when the storage is freed. Tensors that existed before (model weights, inputs) are
registered with `track()`. The peak is exact for storages created through the dispatcher; it does not see
scratch buffers a kernel allocates and frees inside one operator, nor allocator slack (both show up in the
process's VmHWM instead). Weights memory-mapped from a file (`map_frozen_weights`) are registered with
`track(..., mapped=True)` and counted apart, as `mapped_bytes`: they are page cache the kernel may drop and read
again, not anonymous memory.

Because it only reads sizes, the same tracker runs under `FakeTensorMode`: `fake_peak(fn)` gives the live peak of a
step too large to run, through the same code path (see benchmarks/bench_memory.py, which validates it against a
real measurement).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_of(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / nested / opaque tensors have no single storage
        return None


class LiveTensorTracker(TorchDispatchMode):
    """Tracks `live_bytes` and its `peak_bytes` while active (use as a context manager)."""

    def __init__(
        self, tensors: Iterable[torch.Tensor] = (), mapped: Iterable[torch.Tensor] = (), breakdown: bool = False
    ):
        """`breakdown=True` also keeps, in `peak_breakdown`, the live bytes at the peak by the operator that created
        each storage ("weights/inputs" for tensors registered up front): where the peak comes from."""
        super().__init__()
        self.breakdown = breakdown
        self.peak_breakdown: dict[str, int] = {}
        self._origin: dict[int, str] = {}
        self._snapshot_at = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.mapped_bytes = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._mapped: set[int] = set()
        self.track(mapped, mapped=True)  # first: a mapped weight listed in `tensors` too is counted once, as mapped
        self.track(tensors)

    def track(self, tensors: Iterable[torch.Tensor], mapped: bool = False) -> None:
        """Count tensors that exist already (weights, a batch) as live until their storage is freed.

        `mapped=True`: the tensors are file-backed mappings; their bytes go to `mapped_bytes`, not `live_bytes`.
        """
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register(t, mapped, "weights/inputs")

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _register(self, t: torch.Tensor, mapped: bool = False, origin: str = "") -> None:
        storage = _storage_of(t)
        if storage is None:
            return
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self._mapped:
            return
        if key in self._sizes:
            if nbytes != self._sizes[key]:  # resized in place (out= ops)
                self.live_bytes += nbytes - self._sizes[key]
                self._sizes[key] = nbytes
        elif mapped:
            self.mapped_bytes += nbytes
            self._mapped.add(key)
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        else:
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            if self.breakdown:
                self._origin[key] = origin
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            if self.breakdown and self.peak_bytes > self._snapshot_at * 1.01:  # re-snapshot every 1% of growth
                self._snapshot_at = self.peak_bytes
                self.peak_breakdown = {}
                for k, size in self._sizes.items():
                    name = self._origin.get(k, "")
                    self.peak_breakdown[name] = self.peak_breakdown.get(name, 0) + size

    def _free(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)
        self._mapped.discard(key)
        self._origin.pop(key, None)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t, origin=func.__name__ if self.breakdown else "")
        return out


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers of `module` (each storage once), to register as live."""
    return [*module.parameters(), *module.buffers()]


def fake_module(module: torch.nn.Module, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Replace every parameter and buffer of a module built on the meta device by a fake tensor on `device`.

    Call inside a `FakeTensorMode`. Building on "meta" and faking afterwards (rather than building under the fake
    mode) keeps libraries that move parameters at build time working (peft); the fake tensors carry the real device,
    so kernels are chosen as in a real run (CPU flash attention, not the math fallback). A tensor shared by several
    modules (tied embeddings) stays shared.
    """
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)] = new
        return memo[id(t)]

    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    table[name] = fake(t)
    return module


def fake_peak(build: Callable[[], torch.nn.Module], step: Callable[[torch.nn.Module], object]) -> dict:
    """Live-tensor peak of `step(model)` for `model = build()` on fake tensors: nothing is allocated, sizes are exact.

    `build` runs under `torch.device("meta")` and returns the model; its weights become fake CPU tensors
    (`fake_module`), then `step` (one forward + backward that creates its inputs with torch) runs under
    `FakeTensorMode` with the tracker. Returns the bytes of the weights and the peak, as `LiveTensorTracker` counts.
    Import the libraries `build` uses beforehand: a module imported for the first time inside the meta-device
    context would create its import-time tensors on "meta".
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = build()
    with FakeTensorMode(allow_non_fake_inputs=False):
        fake_module(model)
        with LiveTensorTracker(module_tensors(model)) as tracker:
            weights = tracker.live_bytes
            step(model)
    return {"weights_bytes": weights, "peak_bytes": tracker.peak_bytes, "mapped_bytes": tracker.mapped_bytes}
