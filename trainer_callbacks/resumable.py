"""ResumableExecutionCallback: training that survives being killed, on the Trainer's own checkpoint machinery.

The Trainer still writes every checkpoint (`save_strategy="steps"`, `save_steps`) and still resumes from one
(`trainer.train(resume_from_checkpoint=path)`: adapter, optimizer, scheduler, RNG states, mid-epoch data position).
This callback adds what it lacks: checkpoints every M minutes and on SIGTERM/SIGINT (save, then stop cleanly),
an atomic commit with a checksum manifest (see `checkpoint.py`), keeping the last K, a verified resume that falls
back past a corrupt checkpoint, and a refusal to resume a checkpoint from another base model or adapter config.
A save that fails (a full disk) leaves no half-written checkpoint behind: `training_failed` removes it and says
how much space the save needs (PactTrainer calls it; with the stock Trainer, call it where `train` raises).

With the stock Trainer::

    resumable = ResumableExecutionCallback(save_every_minutes=10)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[resumable])
    trainer.train(resume_from_checkpoint=resumable.find_checkpoint(args, model))  # None: start fresh
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from optimum_pact.errors import NoSpaceError
from optimum_pact.files import free_bytes, ran_out_of_space

from .checkpoint import (
    CHECKPOINT_RE,
    MANIFEST_NAME,
    STAGING_MARKER,
    CorruptCheckpointError,
    check_contents,
    commit_checkpoint,
    find_checkpoint,
    folder_bytes,
    identity_mismatch,
    list_checkpoints,
    model_identity,
    read_manifest,
    rotate_checkpoints,
)

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = ("SIGTERM", "SIGINT")


def _distributed() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and (torch.distributed.get_world_size() > 1)
    )


class TrainingInterrupted(RuntimeError):
    """Training stopped on a signal after saving a checkpoint; running the same job again continues it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class ResumableExecutionCallback(TrainerCallback, ExportableState):
    """Periodic, signal-triggered, atomically committed and verified checkpoints (see the module docstring).

    Args:
        save_every_minutes: also checkpoint when this many minutes passed since the last checkpoint.
        handle_signals: on SIGTERM/SIGINT, finish the current optimizer step, checkpoint, and stop training.
            A second signal of the same kind acts as usual (kills / raises KeyboardInterrupt).
        keep: committed checkpoints to keep; None uses `args.save_total_limit` (None there keeps all).
        checkpoint_dir: where committed checkpoints go; None is `<output_dir>/checkpoints`.
        clock: seconds, monotonic; injectable for tests.
    """

    def __init__(
        self,
        save_every_minutes: float | None = None,
        handle_signals: bool = True,
        keep: int | None = None,
        checkpoint_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if save_every_minutes is not None and (
            isinstance(save_every_minutes, bool)
            or not isinstance(save_every_minutes, (int, float))
            or not save_every_minutes > 0
        ):
            raise ValueError(f"save_every_minutes={save_every_minutes!r} must be a positive number of minutes.")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep={keep!r} must be a positive number of checkpoints to keep (or None for all).")
        self.save_every_minutes, self.handle_signals, self.keep = save_every_minutes, handle_signals, keep
        self.checkpoint_dir, self.clock = checkpoint_dir, clock
        self.identity: dict | None = None
        self.stop_signal: int | None = None
        self.resumed_from_step = 0
        self.last_checkpoint: Path | None = None
        self.last_checkpoint_bytes = 0
        self.saved = 0
        self._saving: Path | None = None  # the checkpoint folder being written, until it is committed
        self._trainable_bytes = 0
        self._last_save = 0.0
        self._control = None
        self._previous_handlers: dict[int, object] = {}

    def state(self) -> dict:
        return {
            "args": {
                "save_every_minutes": self.save_every_minutes,
                "handle_signals": self.handle_signals,
                "keep": self.keep,
                "checkpoint_dir": self.checkpoint_dir,
            },
            "attributes": {"identity": self.identity},
        }

    def checkpoints_dir(self, args) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(args.output_dir) / "checkpoints"

    def find_checkpoint(self, args, model=None) -> str | None:
        """The newest verified checkpoint to pass as `resume_from_checkpoint` (None: none yet, start fresh).

        Corrupt checkpoints are reported and moved aside; one from another base model or adapter configuration
        raises ValueError (see `checkpoint.find_checkpoint`).
        """
        found = find_checkpoint(self.checkpoints_dir(args), model, move_corrupt=args.process_index == 0)
        return str(found) if found is not None else None

    @staticmethod
    def check_checkpoint(path: str | Path, model=None) -> dict | None:
        """Verify a committed checkpoint's checksums and contents (and, with `model`, its identity); returns its
        manifest.

        A Trainer checkpoint without a manifest (not written with this callback) is resumed without checksums, with
        a warning (None is returned then), but its files must still read back (`checkpoint.check_contents`). A
        damaged checkpoint raises CorruptCheckpointError naming the file and what to do; a missing folder,
        FileNotFoundError.
        """
        folder = Path(path)
        advice = (
            "; resume from an older checkpoint (find_checkpoint() returns the newest that verifies, moving damaged "
            "ones aside) or pass resume_from_checkpoint=None to start over."
        )
        if not folder.is_dir():
            raise FileNotFoundError(
                f"resume_from_checkpoint={str(path)!r} does not exist; pass a checkpoint folder (find_checkpoint() "
                "returns the newest valid one) or resume_from_checkpoint=None to start over."
            )
        try:
            if not (folder / MANIFEST_NAME).is_file() and (folder / "trainer_state.json").is_file():
                logger.warning(f"resumable: {path} has no {MANIFEST_NAME}; resuming from it without checksums.")
                check_contents(folder)
                return None
            manifest = read_manifest(folder)
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(f"{err}{advice}") from None
        if model is not None:
            reason = identity_mismatch(manifest.get("identity") or {}, model_identity(model))
            if reason is not None:
                raise ValueError(f"refusing to resume from {path}: it was written for {reason}.")
        return manifest

    # ---- signals ----
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("resumable: not in the main thread, so SIGTERM/SIGINT are not handled (no save on kill).")
            return
        for name in HANDLED_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            try:
                signal.signal(signum, handler)
            except (TypeError, ValueError):
                pass
        self._previous_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum
        if self._control is not None:  # save and stop after this step, whichever callback is running now
            self._control.should_save = self._control.should_training_stop = True  # also ends a pacing pause
        previous = self._previous_handlers.pop(signum, signal.SIG_DFL)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    # ---- Trainer events ----
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.identity = model_identity(model) if model is not None else None
        trainable = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        self._trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
        self.resumed_from_step = state.global_step
        saved = (state.stateful_callbacks or {}).get(type(self).__name__) if state.global_step > 0 else None
        saved_identity = saved.get("attributes", {}).get("identity") if isinstance(saved, dict) else None
        if saved_identity and self.identity:
            reason = identity_mismatch(saved_identity, self.identity)
            if reason is not None:
                raise ValueError(f"refusing to resume: the checkpoint was written for {reason}.")
        if state.is_world_process_zero:
            for folder in Path(args.output_dir).glob("checkpoint-*"):
                if CHECKPOINT_RE.match(folder.name) and (folder / STAGING_MARKER).is_file():
                    logger.info(f"resumable: removing {folder}, a checkpoint left unfinished by a killed run")
                    shutil.rmtree(folder, ignore_errors=True)
        self.stop_signal, self._control = None, control
        self._last_save = self.clock()
        if self.handle_signals:
            self._install_signal_handlers()

    def on_step_begin(self, args, state, control, **kwargs):
        self._control = control

    def on_step_end(self, args, state, control, **kwargs):
        self._control = control
        due = self.save_every_minutes is not None and self.clock() - self._last_save >= 60 * self.save_every_minutes
        stop = self.stop_signal is not None
        if _distributed() and (self.handle_signals or self.save_every_minutes is not None):
            flags = torch.tensor([float(stop), float(due)])
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            stop, due = bool(flags[0]), bool(flags[1])
            if stop and self.stop_signal is None:
                self.stop_signal = int(signal.SIGTERM)  # another process was signalled
        if stop:
            name = signal.Signals(self.stop_signal).name if self.stop_signal else "signal"
            logger.warning(f"resumable: {name} received; checkpointing step {state.global_step}, then stopping")
            control.should_save = control.should_training_stop = True
        if due:
            control.should_save = True
        self._mark_staging(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._mark_staging(args, state, control)

    def _mark_staging(self, args, state, control) -> None:
        """Mark the folder the Trainer is about to write, so that a save cut short by a kill is cleaned up later."""
        if control.should_save and state.is_world_process_zero:
            staging = self._saving = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            staging.mkdir(parents=True, exist_ok=True)
            (staging / STAGING_MARKER).touch()

    def on_save(self, args, state, control, **kwargs):
        if _distributed():
            torch.distributed.barrier()  # every process has written its part (e.g. its RNG state)
        if state.is_world_process_zero:
            staging = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if not staging.is_dir():
                logger.error(f"resumable: {staging} was not written; nothing to commit")
            else:
                info = {
                    "global_step": state.global_step,
                    "epoch": state.epoch,
                    "data_position": {
                        "epoch": state.epoch,
                        "global_step": state.global_step,
                        "samples_seen": state.global_step
                        * args.per_device_train_batch_size
                        * args.gradient_accumulation_steps
                        * max(1, args.world_size),
                    },
                    "identity": self.identity,
                    "signal": signal.Signals(self.stop_signal).name if self.stop_signal else None,
                }
                target = commit_checkpoint(staging, self.checkpoints_dir(args), info)
                self._saving = None
                keep = self.keep if self.keep is not None else args.save_total_limit
                removed = rotate_checkpoints(self.checkpoints_dir(args), keep)
                self.last_checkpoint, self.last_checkpoint_bytes = target, folder_bytes(target)
                logger.info(
                    f"resumable: committed {target} ({self.last_checkpoint_bytes / 2**20:.2f} MiB)"
                    + (f", removed {len(removed)} older" if removed else "")
                )
        if _distributed():
            torch.distributed.barrier()
        self.saved += 1
        self._last_save = self.clock()

    def on_train_end(self, args, state, control, **kwargs):
        self._restore_signal_handlers()
        self._control = None

    def training_failed(self, args, err: BaseException) -> NoSpaceError | None:
        """Call when `train` raised `err` (PactTrainer.train does). If a checkpoint was being saved, its half-written
        folder is removed (the committed checkpoints stay as they are) and, when the save ran out of disk space, the
        NoSpaceError to raise instead is returned: it names the folder, the space a checkpoint needs and the space
        free. None: `err` stands."""
        self._restore_signal_handlers()
        self._control = None
        staging, self._saving = self._saving, None
        if staging is None or args.process_index != 0:
            return None
        needed = self._checkpoint_bytes(args)
        full = ran_out_of_space(err, staging.parent, needed)  # measured with the half-written folder still there
        shutil.rmtree(staging, ignore_errors=True)
        logger.info(f"resumable: removed {staging}, a checkpoint left unfinished by a failed save ({err!r})")
        if not full:
            return None
        fix = "free space, then resume from the last committed checkpoint (train(resume_from_checkpoint=True))"
        return NoSpaceError(args.output_dir, staging.name, needed, free_bytes(args.output_dir), fix)

    def _checkpoint_bytes(self, args) -> int:
        """About the size of the next checkpoint: the newest committed one's, or, before the first, the adapter and
        two optimizer states per trainable weight plus the small files."""
        if self.last_checkpoint is not None:
            return self.last_checkpoint_bytes
        committed = list_checkpoints(self.checkpoints_dir(args))
        if committed:
            return folder_bytes(committed[-1])
        return 3 * self._trainable_bytes + (64 << 10)

    def metrics(self) -> dict[str, float]:
        out = {"pact_checkpoints_saved": self.saved}
        if self.last_checkpoint is not None:
            out["pact_checkpoint_mib"] = round(self.last_checkpoint_bytes / 2**20, 3)
        return out
