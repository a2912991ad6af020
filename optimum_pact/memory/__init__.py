"""Memory savers: block checkpointing with selective caching and disk offload, subset softmax, logits masking,
and the allocator setting that lets freed tensors leave the process.

Part of the core: plain torch, duck typing on the model (`layers`, `get_output_embeddings()`, `get_decoder()`); no
peft, Trainer or application imports. `MemorySavers` switches everything on; the pieces are usable alone.
"""

from .accounting import LiveTensorTracker, fake_module, fake_peak, module_tensors
from .allocator import (
    DEFAULT_MMAP_THRESHOLD,
    HeapTrimmer,
    check_mmap_threshold,
    pin_mmap_threshold,
    pinned_mmap_threshold,
    resident_bytes,
    trim_heap,
)
from .checkpoint import BlockCheckpointing, find_blocks
from .logits_mask import causal_lm_loss, labelled_positions
from .offload import ActivationOffloader, OffloadError
from .savers import MEMORY_SAVER_PRESETS, MemorySavers, SaverOutput, enable_memory_savers
from .streaming import WeightStream, streaming_available
from .subset_softmax import DEFAULT_K, TokenNeighbours, check_subset_k, subset_cross_entropy
from .weights import WeightsFile, WeightsFileError, map_frozen_weights

__all__ = [
    "DEFAULT_K",
    "DEFAULT_MMAP_THRESHOLD",
    "MEMORY_SAVER_PRESETS",
    "ActivationOffloader",
    "BlockCheckpointing",
    "LiveTensorTracker",
    "MemorySavers",
    "OffloadError",
    "SaverOutput",
    "TokenNeighbours",
    "WeightStream",
    "WeightsFile",
    "WeightsFileError",
    "causal_lm_loss",
    "check_mmap_threshold",
    "check_subset_k",
    "enable_memory_savers",
    "fake_module",
    "fake_peak",
    "find_blocks",
    "labelled_positions",
    "map_frozen_weights",
    "module_tensors",
    "pin_mmap_threshold",
    "pinned_mmap_threshold",
    "trim_heap",
    "HeapTrimmer",
    "resident_bytes",
    "streaming_available",
    "subset_cross_entropy",
]
