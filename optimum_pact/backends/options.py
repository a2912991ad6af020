"""The check of a backend choice, shared by every config that names one (PactConfig, PactQuantizationConfig)."""

from __future__ import annotations

import json

from ..errors import OptionError
from . import BACKEND_CHOICES


def check_backend_choice(backend: str, backend_options: dict | str | None, prefix: str = "") -> dict | None:
    """Check `backend` (one of `BACKEND_CHOICES`) and `backend_options` (None, a dict keyed by option name, or its
    JSON text); return the options as a dict (or None). The options themselves are checked by the backend. Errors
    name the options `prefix + "backend"` and `prefix + "backend_options"` (e.g. prefix "pact_" in Trainer args)."""
    name, options_name = f"{prefix}backend", f"{prefix}backend_options"
    if not isinstance(backend, str) or backend not in BACKEND_CHOICES:
        raise OptionError(
            name,
            f"{name}={backend!r} is not a known backend; choose one of {', '.join(map(repr, BACKEND_CHOICES))}.",
        )
    options = backend_options
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError as err:
            raise OptionError(
                options_name,
                f"{options_name}={backend_options!r} is not valid JSON ({err.msg}); write a JSON object, "
                'e.g. \'{"soc_model": "69"}\'.',
            ) from None
    if options is not None and (not isinstance(options, dict) or not all(isinstance(k, str) for k in options)):
        raise OptionError(
            options_name,
            f"{options_name}={backend_options!r} must be a dict of option name -> value, e.g. "
            "{'soc_model': '69'} or {'tile_size': 256}, or None.",
        )
    return options


__all__ = ["check_backend_choice"]
