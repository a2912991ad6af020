"""`--resume` for the long benchmarks: an interrupted run's results.json is kept only for the same settings."""

from __future__ import annotations

from pathlib import Path


def check_settings(saved: Path, saved_config: dict, config: dict) -> None:
    """Stop with the settings that differ (saved, now): mixing runs of other settings would compare unlike runs."""
    differ = {k: (saved_config.get(k), v) for k, v in config.items() if saved_config.get(k) != v}
    if differ:
        raise SystemExit(
            f"--resume: {saved} was run with other settings (saved, now): {differ}; pass the saved ones, or drop "
            "--resume / choose another --output to start afresh."
        )
