"""The sections of docs/benchmarks.md (benchmarks/write_docs.py): how one is registered, and what is written above
each: the heading, the command, and the machine and date the results file recorded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Section:
    folder: str  # under benchmarks/results, e.g. "personalization"
    title: str
    command: str  # the command that wrote the results file
    render: Callable[[dict], str]  # results -> markdown body
    note: str = ""  # how the command was run, where one line of flags does not say it all
    date_if_unrecorded: str | None = None  # for results files written before their script recorded a date


SECTIONS: dict[str, Section] = {}  # in the order the page shows them


def section(folder: str, title: str, command: str, note: str = "", date_if_unrecorded: str | None = None):
    """Register `render(results) -> markdown` as the section of benchmarks/results/<folder>/results.json."""

    def register(render: Callable[[dict], str]) -> Callable[[dict], str]:
        SECTIONS[folder] = Section(folder, title, command, render, note, date_if_unrecorded)
        return render

    return register


# ---- what a results file recorded about where and when it ran ----


def cpu_words(cpu: str) -> str:
    """A recorded CPU in one style: "AMD EPYC (no AMX, AVX-512, AVX512-BF16)" stays; the older
    "AMD EPYC; amx=False; avx512_bf16=True" becomes "AMD EPYC (no AMX, AVX512-BF16)"."""
    name, *flags = [part.strip() for part in cpu.split(";")]
    if not flags:
        return name
    values = dict(flag.split("=", 1) for flag in flags)
    words = ["AMX" if values.get("amx") == "True" else "no AMX"]
    words.append("AVX512-BF16" if values.get("avx512_bf16") == "True" else "no AVX512-BF16")
    return f"{name} ({', '.join(words)})"


def machine_words(machine: str) -> str:
    """ "x86_64, 2 CPU cores, Linux; AMD EPYC (no AMX, ...)" -> "AMD EPYC (no AMX, ...), 2 CPU cores, x86_64 Linux";
    a bare CPU (aqlora_accuracy.py records only that) stays as `cpu_words` gives it."""
    platform, _, cpu = machine.partition("; ")
    parts = [part.strip() for part in platform.split(",")]
    if not cpu or len(parts) != 3:
        return cpu_words(machine)
    arch, cores, system = parts
    return f"{cpu_words(cpu)}, {cores}, {arch} {system}"


def where_and_when(results: dict, spec: Section) -> list[tuple[str, list[str]]]:
    """[(machine, its dates)] in the order the machines first ran: a run resumed over sittings records each sitting
    (`pieces`); others record one machine (or CPU) and date."""
    pieces = results.get("pieces") or [results]
    found: dict[str, list[str]] = {}
    for piece in pieces:
        machine = piece.get("machine") or piece.get("cpu")
        date = piece.get("date") or spec.date_if_unrecorded
        if machine is None or date is None:
            raise SystemExit(
                f"benchmarks/results/{spec.folder}/results.json records no "
                f"{'machine' if machine is None else 'date'}: every figure in docs/ names both (pass "
                "date_if_unrecorded= to its @section for a file written before its script recorded the date)."
            )
        dates = found.setdefault(machine_words(machine), [])
        if date not in dates:
            dates.append(date)
    return [(machine, sorted(dates)) for machine, dates in found.items()]


def header(spec: Section, results: dict) -> str:
    path = f"benchmarks/results/{spec.folder}/results.json"
    ran = where_and_when(results, spec)
    recorded = results.get("date") or results.get("pieces")
    unrecorded = "" if recorded else " (the day it was committed: the results file records no date)"
    note = f" ({spec.note})" if spec.note else ""
    lines = [f"## {spec.title}", "", f"- results: [`{path}`](../{path})", f"- written by: `{spec.command}`{note}"]
    if len(ran) == 1:
        machine, dates = ran[0]
        lines += [f"- machine: {machine}", f"- date: {', '.join(dates)}{unrecorded}"]
    else:
        lines.append("- machines and dates (a run resumed over sittings):")
        lines += [f"  - {', '.join(dates)}: {machine}" for machine, dates in ran]
    return "\n".join(lines)


def plots(folder: Path, root: Path) -> str:
    """The charts (.png, .svg) a benchmark wrote beside its results, embedded from docs/ (`root`: the repository)."""
    found = sorted(p for p in folder.iterdir() if p.suffix in (".png", ".svg"))
    rel = [p.relative_to(root).as_posix() for p in found]
    return "\n".join(f"![{p.stem.replace('_', ' ')}](../{r})" for p, r in zip(found, rel))
