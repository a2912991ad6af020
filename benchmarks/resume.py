"""`--resume` for the long benchmarks: an interrupted run's results.json is kept only for the same settings."""

from __future__ import annotations

from pathlib import Path


def ran_dtype(name: str) -> str:
    """The dtype `--dtype name` computes in on this CPU ("auto" is fp32 on one, bf16 on another): the setting a
    resumed run must keep, where the name as typed may differ."""
    from optimum_pact.precision import resolve_dtype

    return str(resolve_dtype(name)).removeprefix("torch.")


def check_settings(saved: Path, saved_config: dict, config: dict) -> None:
    """Stop with the settings that differ (saved, now): mixing runs of other settings would compare unlike runs."""
    differ = {k: (saved_config.get(k), v) for k, v in config.items() if saved_config.get(k) != v}
    if differ:
        raise SystemExit(
            f"--resume: {saved} was run with other settings (saved, now): {differ}; pass the saved ones, or drop "
            "--resume / choose another --output to start afresh."
        )
