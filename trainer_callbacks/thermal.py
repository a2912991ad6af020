"""ThermalPacingCallback: pause training between steps so a phone or laptop stays cool and on power.

Sensors are Linux sysfs files: thermal zones `<root>/class/thermal/thermal_zone*/{type,temp}` (millidegrees
Celsius) and power supplies `<root>/class/power_supply/*/{type,status,capacity,online}`. Missing or unreadable
sensors never stop training: the callback warns once and that part of the policy is off (documented per option).
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from optimum_pact.errors import OptionError

logger = logging.getLogger(__name__)

# Zone `type` patterns (case-insensitive globs). Phones expose a skin (case) sensor, which is what must stay cool;
# its CPU zones swing by tens of degrees within a second under load. Laptops expose CPU package zones.
SKIN_ZONES = ("*skin*", "quiet-therm*", "xo-therm*", "mtktsap")
CPU_ZONES = ("cpu*", "*cpuss*", "mtktscpu", "soc_thermal", "x86_pkg_temp", "tcpu", "acpitz")
DEFAULT_LIMIT_C = {"skin": 40.0, "cpu": 85.0}
LIMIT_RANGE_C = (30.0, 105.0)
CHARGING_STATUSES = ("charging", "full")


def check_limit(option: str, value: float | None) -> None:
    """ValueError naming `option` unless `value` is None or a plausible limit in degrees Celsius."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise OptionError(
            option, f"{option}={value!r} must be a temperature in degrees Celsius, e.g. 40 for a phone's skin."
        )
    low, high = LIMIT_RANGE_C
    if low <= value <= high:
        return
    hint = f" It looks like millidegrees: use {value / 1000:g}." if value >= 1000 else ""
    raise OptionError(
        option,
        f"{option}={value!r} is outside {low:g}-{high:g} degrees Celsius.{hint} Use about 40 for a phone's skin "
        f"sensor or 85 for a CPU sensor (below {low:g} the device could never cool enough to train).",
    )


def check_pacing_options(
    limit_c: float | None,
    hysteresis_c: float = 2.0,
    duty_cycle: float | None = None,
    min_battery: int | None = None,
    poll_seconds: float = 2.0,
    names: dict[str, str] | None = None,
) -> None:
    """The validation shared by the callback and `PactTrainingArguments`; `names` maps each argument to the option
    name its caller declares (default: the argument names). Raises `OptionError` naming that option."""
    name = {k: k for k in ("limit_c", "hysteresis_c", "duty_cycle", "min_battery", "poll_seconds")}
    name.update(names or {})
    check_limit(name["limit_c"], limit_c)
    if isinstance(hysteresis_c, bool) or not isinstance(hysteresis_c, (int, float)) or not 0 < hysteresis_c <= 20:
        raise OptionError(
            name["hysteresis_c"],
            f"{name['hysteresis_c']}={hysteresis_c!r} must be a number of degrees in (0, 20]; training resumes "
            "once the sensor is this far below the limit (try 2).",
        )
    if duty_cycle is not None and (
        isinstance(duty_cycle, bool) or not isinstance(duty_cycle, (int, float)) or not 0 < duty_cycle <= 1
    ):
        raise OptionError(
            name["duty_cycle"],
            f"{name['duty_cycle']}={duty_cycle!r} must be in (0, 1]: the fraction of time spent training "
            "(0.5 rests as long as each step took); None trains flat out.",
        )
    if min_battery is not None and (
        isinstance(min_battery, bool) or not isinstance(min_battery, int) or not 0 <= min_battery <= 100
    ):
        raise OptionError(
            name["min_battery"],
            f"{name['min_battery']}={min_battery!r} must be a battery percentage, an integer in 0-100.",
        )
    if isinstance(poll_seconds, bool) or not isinstance(poll_seconds, (int, float)) or not 0 < poll_seconds <= 600:
        raise OptionError(
            name["poll_seconds"],
            f"{name['poll_seconds']}={poll_seconds!r} must be in (0, 600]: how often sensors are read while "
            "paused (try 2).",
        )


@dataclass(frozen=True)
class ThermalZone:
    name: str  # thermal_zone3
    type: str  # skin-therm
    temp_path: Path


def _read(path: Path) -> str:
    return path.read_text().strip()


def discover_zones(sysfs_root: str | Path) -> list[ThermalZone]:
    """Every thermal zone with a readable `type` under `<sysfs_root>/class/thermal`, in name order."""
    zones = []
    for folder in sorted(Path(sysfs_root, "class", "thermal").glob("thermal_zone*")):
        try:
            zones.append(ThermalZone(folder.name, _read(folder / "type"), folder / "temp"))
        except OSError:
            continue
    return zones


def select_zones(zones: Sequence[ThermalZone], patterns: Sequence[str] | None) -> tuple[list[ThermalZone], str]:
    """(zones that count, their kind): `patterns` if given ("custom"), else skin zones if any, else CPU zones."""

    def matching(pats):
        return [z for z in zones if any(fnmatch.fnmatch(z.type.lower(), p.lower()) for p in pats)]

    if patterns:
        return matching(patterns), "custom"
    skin = matching(SKIN_ZONES)
    return (skin, "skin") if skin else (matching(CPU_ZONES), "cpu")


def read_celsius(zone: ThermalZone) -> float:
    """The zone's temperature. sysfs reports millidegrees; a few vendor drivers report whole degrees."""
    raw = float(_read(zone.temp_path))
    return raw / 1000.0 if abs(raw) >= 1000 else raw


@dataclass
class PowerState:
    supplies: int  # power-supply entries found
    on_external_power: bool | None  # None: no information (no supplies)
    battery_percent: int | None  # lowest system battery capacity; None without one


def read_power(sysfs_root: str | Path) -> PowerState:
    """External power: a system battery Charging/Full, or a non-battery supply (Mains, USB, ...) with online=1."""
    folders = sorted(Path(sysfs_root, "class", "power_supply").glob("*"))
    charging, capacities, found = False, [], 0
    for folder in folders:
        try:
            kind = _read(folder / "type").lower()
        except OSError:
            continue
        found += 1
        if kind == "battery":
            try:
                if _read(folder / "scope").lower() == "device":  # a mouse's or a headset's battery
                    continue
            except OSError:
                pass
            try:
                charging |= _read(folder / "status").lower() in CHARGING_STATUSES
            except OSError:
                pass
            try:
                capacities.append(int(_read(folder / "capacity")))
            except (OSError, ValueError):
                pass
        else:
            try:
                charging |= _read(folder / "online") == "1"
            except OSError:
                pass
    return PowerState(found, charging if found else None, min(capacities) if capacities else None)


class ThermalPacingCallback(TrainerCallback, ExportableState):
    """Pauses between optimizer steps while the device is too hot, off the charger or low on battery.

    - Thermal: once the hottest selected zone reaches `limit_c`, training waits until it is at or below
      `limit_c - hysteresis_c`. Zones: `zones` (type globs) if given, else the phone's skin zones, else the CPU
      zones; `limit_c=None` means 40 C on skin zones and 85 C on CPU zones. No matching or readable zone: one
      warning, and training runs without thermal pauses.
    - Duty cycle: after each step, rest so that training takes at most `duty_cycle` of the time.
    - `only_while_charging`: wait while no external power is seen. No power-supply entries at all (a desktop):
      one warning, and the machine counts as on external power.
    - `min_battery`: wait while the system battery is below this percentage. No battery: one warning, no check.

    Waits poll every `poll_seconds` and end early when training is stopping (e.g. on SIGTERM). Every pause is
    logged with its reason and counted (`metrics()`). `sleep` and `clock` are injectable for tests.
    """

    def __init__(
        self,
        limit_c: float | None = None,
        hysteresis_c: float = 2.0,
        zones: Sequence[str] | None = None,
        duty_cycle: float | None = None,
        only_while_charging: bool = False,
        min_battery: int | None = None,
        sysfs_root: str = "/sys",
        poll_seconds: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        check_pacing_options(limit_c, hysteresis_c, duty_cycle, min_battery, poll_seconds)
        if zones and limit_c is None:
            raise ValueError(f"zones={list(zones)!r} needs an explicit limit_c (degrees Celsius) for those sensors.")
        self.limit_c, self.hysteresis_c = limit_c, hysteresis_c
        self.zones = list(zones) if zones else None
        self.duty_cycle, self.only_while_charging, self.min_battery = duty_cycle, only_while_charging, min_battery
        self.sysfs_root, self.poll_seconds = str(sysfs_root), poll_seconds
        self.sleep, self.clock = sleep, clock
        self.selected: list[ThermalZone] = []
        self.active_limit_c: float | None = None
        self._warned: set[str] = set()
        self._step_start: float | None = None
        self.counts = {"thermal": 0, "power": 0, "battery": 0}
        self.paused_seconds = {"thermal": 0.0, "power": 0.0, "battery": 0.0, "duty": 0.0}
        self.train_seconds = 0.0  # inside optimizer steps (all sessions of a resumed run)
        self.last_temperature_c: float | None = None
        self.max_temperature_c: float | None = None

    # ---- ExportableState: counters survive a resume (read back in on_train_begin) ----
    def state(self) -> dict:
        return {
            "args": {
                "limit_c": self.limit_c,
                "hysteresis_c": self.hysteresis_c,
                "zones": self.zones,
                "duty_cycle": self.duty_cycle,
                "only_while_charging": self.only_while_charging,
                "min_battery": self.min_battery,
                "sysfs_root": self.sysfs_root,
                "poll_seconds": self.poll_seconds,
            },
            "attributes": {
                "counts": dict(self.counts),
                "paused_seconds": dict(self.paused_seconds),
                "train_seconds": self.train_seconds,
                "max_temperature_c": self.max_temperature_c,
            },
        }

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    # ---- Trainer events ----
    def on_train_begin(self, args, state, control, **kwargs):
        saved = (state.stateful_callbacks or {}).get(type(self).__name__) if state.global_step > 0 else None
        if isinstance(saved, dict):
            for name, value in saved.get("attributes", {}).items():
                setattr(self, name, value)
        zones = discover_zones(self.sysfs_root)
        self.selected, kind = select_zones(zones, self.zones)
        self.active_limit_c = self.limit_c if self.limit_c is not None else DEFAULT_LIMIT_C.get(kind)
        if self.selected:
            names = ", ".join(f"{z.name} ({z.type})" for z in self.selected)
            logger.info(f"thermal pacing: limit {self.active_limit_c:g} C on {names}")
        else:
            wanted = ", ".join(self.zones or SKIN_ZONES + CPU_ZONES)
            found = ", ".join(sorted({z.type for z in zones})) or "none"
            self._warn_once(
                "no-zone",
                f"thermal pacing: no thermal zone under {self.sysfs_root}/class/thermal matches [{wanted}] (found: "
                f"{found}); training runs without thermal pauses. Pass zones=/pact_thermal_zones to choose sensors.",
            )

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is None:
            return
        step_seconds = self.clock() - self._step_start
        self.train_seconds += step_seconds
        if self.duty_cycle is not None and self.duty_cycle < 1 and not control.should_training_stop:
            rest = step_seconds * (1 - self.duty_cycle) / self.duty_cycle
            self.paused_seconds["duty"] += self._wait(rest, control, lambda: False)
        self._pace(control)

    # ---- policy ----
    def temperature_c(self) -> float | None:
        """The hottest selected zone now; None when none reads (each failing zone is warned about once)."""
        readings = []
        for zone in self.selected:
            try:
                readings.append(read_celsius(zone))
            except (OSError, ValueError) as err:
                self._warn_once(f"read-{zone.name}", f"thermal pacing: cannot read {zone.temp_path} ({err}); skipped.")
        if not readings:
            if self.selected:
                self._warn_once("no-reading", "thermal pacing: no selected sensor reads; no thermal pauses for now.")
            return None
        temp = max(readings)
        self.last_temperature_c = temp
        self.max_temperature_c = temp if self.max_temperature_c is None else max(self.max_temperature_c, temp)
        return temp

    def blocking_reason(self, hot: bool = False) -> tuple[str, str] | None:
        """(kind, message) for what keeps training paused now, or None. `hot`: already pausing for heat."""
        temp = self.temperature_c() if self.active_limit_c is not None else None
        if temp is not None:
            resume_at = self.active_limit_c - self.hysteresis_c
            if temp >= self.active_limit_c or (hot and temp > resume_at):
                return "thermal", f"{temp:.1f} C >= limit {self.active_limit_c:g} C; resuming at {resume_at:g} C"
        if self.only_while_charging or self.min_battery is not None:
            power = read_power(self.sysfs_root)
            if self.only_while_charging:
                if power.on_external_power is None:
                    self._warn_once(
                        "no-power",
                        f"pacing: no power supply under {self.sysfs_root}/class/power_supply; "
                        "assuming external power (a desktop).",
                    )
                elif not power.on_external_power:
                    return "power", "not charging (only_while_charging)"
            if self.min_battery is not None:
                if power.battery_percent is None:
                    self._warn_once("no-battery", "pacing: no battery capacity to read; min_battery is not checked.")
                elif power.battery_percent < self.min_battery:
                    return "battery", f"battery {power.battery_percent}% < {self.min_battery}%"
        return None

    def _pace(self, control) -> None:
        reason = self.blocking_reason()
        while reason is not None and not control.should_training_stop:
            kind, message = reason
            self.counts[kind] += 1
            logger.info(f"pacing: pause ({kind}): {message}")
            waited = self._wait(None, control, lambda k=kind: self._still_blocked(k))
            self.paused_seconds[kind] += waited
            logger.info(f"pacing: resumed after {waited:.1f} s ({kind})")
            reason = self.blocking_reason()

    def _still_blocked(self, kind: str) -> bool:
        reason = self.blocking_reason(hot=kind == "thermal")
        return reason is not None and reason[0] == kind

    def _wait(self, seconds: float | None, control, blocked: Callable[[], bool]) -> float:
        """Sleep `seconds` (None: while `blocked()`), in polls, returning early when training is stopping."""
        start = self.clock()
        while not control.should_training_stop:
            left = None if seconds is None else seconds - (self.clock() - start)
            if left is not None and left <= 0:
                break
            self.sleep(self.poll_seconds if left is None else min(self.poll_seconds, left))
            if seconds is None and not blocked():
                break
        return self.clock() - start

    def metrics(self) -> dict[str, float]:
        """Counts and seconds of pauses by reason, the temperatures read, and the duty cycle reached: the time in
        steps over the time in steps, pauses and rests (saving, logging and evaluation are left out)."""
        paced = self.train_seconds + sum(self.paused_seconds.values())
        out = {
            "pact_pauses": sum(self.counts.values()),
            **{f"pact_pauses_{kind}": n for kind, n in self.counts.items()},
            "pact_paused_seconds": round(sum(self.paused_seconds.values()), 3),
            "pact_duty_cycle": round(self.train_seconds / paced, 4) if paced > 0 else 1.0,
        }
        if self.last_temperature_c is not None:
            out["pact_temperature_c"] = self.last_temperature_c
            out["pact_max_temperature_c"] = self.max_temperature_c
        return out
