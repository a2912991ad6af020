"""ThermalPacingCallback against a fake sysfs tree of real files driven by a first-order thermal model."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import get_peft_model
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from peft_ext import PactConfig
from trainer_callbacks import PactTrainer, PactTrainingArguments, ThermalPacingCallback
from trainer_callbacks.thermal import discover_zones, read_power, select_zones

AMBIENT, LIMIT, HYSTERESIS = 30.0, 40.0, 2.0
MARGIN = 0.5  # stated margin: pacing acts between steps, so a step's own heating may overshoot (<= 0.125 C here)


class FakeDevice:
    """`<root>/class/thermal` and `<root>/class/power_supply` as real files, updated by a thermal model.

    Training heats the skin towards AMBIENT + rise (55 C: too hot to train flat out); idling cools it towards
    AMBIENT, both with time constant `tau` s. The CPU zone reads 25 C above the skin. While charging, the battery
    gains 1% a minute. `sleep` and `clock` advance the model's time, so an hour runs in milliseconds.
    """

    def __init__(self, root: Path, rise: float = 25.0, tau: float = 120.0, battery: dict | None = None):
        self.root, self.rise, self.tau = root, rise, tau
        self.now, self.temp, self.max_temp = 0.0, AMBIENT, AMBIENT
        self.trained = 0.0
        thermal = root / "class" / "thermal"
        for index, kind in enumerate(("skin-therm", "cpu-0-0-usr", "battery")):
            (thermal / f"thermal_zone{index}").mkdir(parents=True)
            (thermal / f"thermal_zone{index}" / "type").write_text(kind + "\n")
        self.battery, self._written_battery, self._minute = battery, None, None
        if battery is not None:
            folder = root / "class" / "power_supply" / "battery"
            folder.mkdir(parents=True)
            (folder / "type").write_text("Battery\n")
            usb = root / "class" / "power_supply" / "usb"
            usb.mkdir(parents=True)
            (usb / "type").write_text("USB\n")
        self._write()

    def _write(self) -> None:
        """Rewrite the sensor files: the skin zone always, the others when a model minute has passed or changed."""
        thermal = self.root / "class" / "thermal"
        minute = int(self.now // 60)
        values = (self.temp, self.temp + 25, self.temp - 2) if minute != self._minute else (self.temp,)
        self._minute = minute
        for index, value in enumerate(values):
            path = thermal / f"thermal_zone{index}" / "temp"
            if path.parent.is_dir():
                path.write_text(f"{round(value * 1000)}\n")
        shown = (self.battery["status"], int(self.battery["capacity"])) if self.battery is not None else None
        if shown != self._written_battery:
            self._written_battery = shown
            folder = self.root / "class" / "power_supply"
            (folder / "battery" / "status").write_text(self.battery["status"] + "\n")
            (folder / "battery" / "capacity").write_text(f"{int(self.battery['capacity'])}\n")
            (folder / "usb" / "online").write_text("1\n" if self.battery["status"] == "Charging" else "0\n")

    def advance(self, seconds: float, training: bool) -> None:
        target = AMBIENT + (self.rise if training else 0.0)
        self.temp = target + (self.temp - target) * math.exp(-seconds / self.tau)
        self.max_temp = max(self.max_temp, self.temp)  # monotonic within a phase: the end is the extreme
        self.now += seconds
        self.trained += seconds if training else 0.0
        if self.battery is not None:
            if self.battery.get("plug_in_at") is not None and self.now >= self.battery["plug_in_at"]:
                self.battery["status"] = "Charging"
            if self.battery["status"] == "Charging":
                self.battery["capacity"] = min(100.0, self.battery["capacity"] + seconds / 60)
        self._write()

    def sleep(self, seconds: float) -> None:
        self.advance(seconds, training=False)

    def clock(self) -> float:
        return self.now


def _simulate(device: FakeDevice, pacer: ThermalPacingCallback, seconds: float, step_s: float = 1.0) -> int:
    """Drive the pacer as the Trainer does, one `step_s` step at a time, for `seconds` of model time."""
    args, state, control = None, TrainerState(), TrainerControl()
    pacer.on_train_begin(args, state, control)
    while device.now < seconds:
        pacer.on_step_begin(args, state, control)
        device.advance(step_s, training=True)
        state.global_step += 1
        pacer.on_step_end(args, state, control)
    return state.global_step


def _pacer(device: FakeDevice, **kw) -> ThermalPacingCallback:
    return ThermalPacingCallback(sysfs_root=str(device.root), sleep=device.sleep, clock=device.clock, **kw)


def test_pacer_keeps_the_modelled_skin_under_the_limit_without_wasting_time(tmp_path, capsys):
    device = FakeDevice(tmp_path)
    pacer = _pacer(device, limit_c=LIMIT, hysteresis_c=HYSTERESIS, poll_seconds=1.0)
    hours = 1.0
    steps = _simulate(device, pacer, hours * 3600)
    metrics = pacer.metrics()
    optimum = (LIMIT - AMBIENT) / device.rise  # the duty cycle that holds the skin exactly at the limit
    assert [z.type for z in pacer.selected] == ["skin-therm"]  # the skin zone, not the 25 C hotter CPU zone
    assert device.max_temp <= LIMIT + MARGIN
    assert metrics["pact_pauses_thermal"] > 10 and metrics["pact_max_temperature_c"] <= LIMIT + MARGIN
    assert metrics["pact_duty_cycle"] == pytest.approx(device.trained / device.now, abs=1e-3)
    assert metrics["pact_duty_cycle"] >= 0.85 * optimum
    with capsys.disabled():
        print(
            f"\nthermal model: max {device.max_temp:.2f} C vs limit {LIMIT} C (+{MARGIN} margin); duty cycle "
            f"{metrics['pact_duty_cycle']:.3f} vs optimum {optimum:.3f}; {steps / hours:.0f} steps/h vs "
            f"{3600:.0f} flat out; {metrics['pact_pauses_thermal']} thermal pauses"
        )
    unpaced = FakeDevice(tmp_path / "unpaced")
    unpaced.advance(hours * 3600, training=True)
    assert unpaced.max_temp > LIMIT + 10  # without pacing the same model overheats


def test_duty_cycle_rests_between_steps(tmp_path):
    device = FakeDevice(tmp_path, rise=1.0)  # never near the limit
    pacer = _pacer(device, limit_c=LIMIT, duty_cycle=0.25)
    _simulate(device, pacer, 400)
    assert pacer.metrics()["pact_duty_cycle"] == pytest.approx(0.25, abs=0.01)
    assert pacer.metrics()["pact_pauses"] == 0  # rests are not pauses
    assert pacer.paused_seconds["duty"] == pytest.approx(300, abs=4)


def test_waits_for_the_charger_and_for_battery(tmp_path, caplog):
    device = FakeDevice(tmp_path, rise=1.0, battery={"status": "Discharging", "capacity": 15, "plug_in_at": 600})
    pacer = _pacer(device, limit_c=LIMIT, only_while_charging=True, min_battery=20, poll_seconds=5)
    with caplog.at_level(logging.INFO, logger="trainer_callbacks.thermal"):
        _simulate(device, pacer, 1000)
    metrics = pacer.metrics()
    assert metrics["pact_pauses_power"] == 1 and pacer.paused_seconds["power"] == pytest.approx(600, abs=5)
    assert metrics["pact_pauses_battery"] == 1 and pacer.paused_seconds["battery"] == pytest.approx(300, abs=6)
    assert "pause (power): not charging" in caplog.text and "pause (battery): battery 15% < 20%" in caplog.text
    assert read_power(device.root).on_external_power is True


def test_missing_sensors_warn_once_and_never_crash(tmp_path, caplog):
    (tmp_path / "class").mkdir()
    device = FakeDevice(tmp_path / "dev", rise=1.0)
    pacer = ThermalPacingCallback(sysfs_root=str(tmp_path), only_while_charging=True, min_battery=50)
    with caplog.at_level(logging.WARNING):
        _simulate(device, pacer, 5)  # the pacer reads the empty tree: a desktop without sensors
    assert "no thermal zone under" in caplog.text and "training runs without thermal pauses" in caplog.text
    assert "assuming external power" in caplog.text and caplog.text.count("no thermal zone under") == 1
    assert pacer.metrics()["pact_pauses"] == 0

    caplog.clear()
    pacer = _pacer(device, limit_c=LIMIT)
    args, state, control = None, TrainerState(), TrainerControl()
    pacer.on_train_begin(args, state, control)
    (device.root / "class" / "thermal" / "thermal_zone0" / "temp").unlink()  # a sensor vanishes mid-run
    (device.root / "class" / "thermal" / "thermal_zone0").rename(device.root / "gone")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            pacer.on_step_begin(args, state, control)
            pacer.on_step_end(args, state, control)
    assert "cannot read" in caplog.text and "no selected sensor reads" in caplog.text


def test_default_zones_prefer_skin_then_cpu(tmp_path):
    device = FakeDevice(tmp_path)
    zones = discover_zones(device.root)
    assert [z.type for z in select_zones(zones, None)[0]] == ["skin-therm"]
    assert select_zones([z for z in zones if z.type != "skin-therm"], None)[1] == "cpu"
    assert [z.type for z in select_zones(zones, ["BATT*"])[0]] == ["battery"]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"pact_thermal_limit_c": -5}, r"pact_thermal_limit_c=-5 is outside 30-105 degrees Celsius"),
        ({"pact_thermal_limit_c": 45000}, r"looks like millidegrees: use 45"),
        ({"pact_thermal_limit_c": 500.0}, r"pact_thermal_limit_c=500.0 is outside"),
        ({"pact_thermal_hysteresis_c": 0}, r"pact_thermal_hysteresis_c=0 must be"),
        ({"pact_duty_cycle": 1.5}, r"pact_duty_cycle=1.5 must be in \(0, 1\]"),
        ({"pact_min_battery": 150}, r"pact_min_battery=150 must be a battery percentage"),
        ({"pact_thermal_zones": "skin*"}, r"needs pact_thermal_limit_c"),
    ],
)
def test_bad_pacing_options_are_clear_errors(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        PactTrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)


def _data() -> Dataset:
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def test_pacer_on_the_stock_trainer_with_a_heating_model(tmp_path):
    device = FakeDevice(tmp_path / "sys", rise=25.0, tau=120.0)

    class Heat(TrainerCallback):  # each real step counts as 30 s of training on the modelled phone
        def on_step_end(self, args, state, control, **kwargs):
            device.advance(30.0, training=True)

    pacer = _pacer(device, limit_c=LIMIT, poll_seconds=1.0)
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        max_steps=12, per_device_train_batch_size=4,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=_data(), callbacks=[Heat, pacer]).train()
    assert pacer.metrics()["pact_pauses_thermal"] >= 3
    assert device.max_temp <= LIMIT + 25 * (1 - math.exp(-30 / 120))  # at most one step's heating over the limit


def test_pact_trainer_wires_pacing_from_fields_and_logs_the_pauses(tmp_path):
    device = FakeDevice(tmp_path / "sys")

    class HotThenFan(TrainerCallback):  # step 1 leaves the phone at 41 C; a "fan" cools it 0.3 s later
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                device.temp = 41.0
                device.advance(0, training=False)
                threading.Timer(0.3, lambda: (setattr(device, "temp", 30.0), device.advance(0, False))).start()

    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
    args = PactTrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        max_steps=4, logging_steps=2, per_device_train_batch_size=4, pact_thermal_limit_c=LIMIT,
        pact_sysfs_root=str(device.root), pact_pacing_poll_seconds=0.05,
    )  # fmt: skip
    trainer = PactTrainer(model=model, args=args, train_dataset=_data(), callbacks=[HotThenFan])
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert logs[0]["pact_pauses_thermal"] == 1 and logs[0]["pact_paused_seconds"] >= 0.2
    assert logs[0]["pact_max_temperature_c"] == pytest.approx(41.0) and logs[-1]["pact_temperature_c"] < 38


def test_pause_counts_survive_a_resume(tmp_path):
    """The pacer's counters travel in the Trainer's checkpoint (ExportableState) and continue after a resume."""
    import os
    import signal

    device = FakeDevice(tmp_path / "sys")

    class HotThenFanThenKill(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:  # the resumed run starts at step 4: only the first run is stopped
                os.kill(os.getpid(), signal.SIGTERM)  # saved and stopped at the end of step 4

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                device.temp = 41.0
                device.advance(0, training=False)
                threading.Timer(0.3, lambda: (setattr(device, "temp", 30.0), device.advance(0, False))).start()

    def run():
        model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
        args = PactTrainingArguments(
            output_dir=str(tmp_path / "run"), report_to="none", use_cpu=True, disable_tqdm=True, max_steps=8,
            per_device_train_batch_size=4, pact_thermal_limit_c=LIMIT, pact_sysfs_root=str(device.root),
            pact_pacing_poll_seconds=0.05, pact_resumable=True, save_strategy="no",
        )  # fmt: skip
        trainer = PactTrainer(model=model, args=args, train_dataset=_data(), callbacks=[HotThenFanThenKill])
        trainer.train(resume_from_checkpoint=trainer.find_checkpoint())
        return trainer

    first = run()
    assert first.state.global_step == 4 and first.pacer.counts["thermal"] == 1
    second = run()
    assert second.resumable.resumed_from_step == 4 and second.state.global_step == 8
    assert second.pacer.counts["thermal"] == 1 and second.pacer.paused_seconds["thermal"] >= 0.2
    assert second.pacer.train_seconds > first.pacer.train_seconds
