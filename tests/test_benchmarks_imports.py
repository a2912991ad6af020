"""Housekeeping read from the source alone (ast, nothing imported): no two benchmarks import each other in a circle
(shared helpers live in benchmarks/common.py), and no Python file grows past 600 lines (STYLE.md). Also: the GPU
benchmark, which no test machine can run, at least starts here and says what it needs.

    python tests/test_benchmarks_imports.py    # prints the benchmarks' import graph and its cycles
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
CHECKED_FOLDERS = ("optimum_pact", "peft_ext", "trainer_callbacks", "benchmarks", "tests", "examples")
MAX_LINES = 600


def import_graph(folder: Path = BENCH) -> dict[str, set[str]]:
    """Module -> the modules of `folder` it imports, anywhere in the file (late imports inside functions too)."""
    files = {path.stem: path for path in sorted(folder.glob("*.py"))}
    graph = {}
    for name, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[name] = {other for other in imported if other in files and other != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import circle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def long_files(root: Path = ROOT, limit: int = MAX_LINES) -> dict[str, int]:
    """Every .py file of the checked folders with more than `limit` lines: path -> lines."""
    out = {}
    for folder in CHECKED_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                out[str(path.relative_to(root))] = lines
    return out


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_late_imports_count(tmp_path):
    (tmp_path / "one.py").write_text("import two\n")
    (tmp_path / "two.py").write_text("def main():\n    from one import x\n")
    (tmp_path / "three.py").write_text("import json\nfrom . import one\n")  # stdlib and relative: not edges
    assert import_graph(tmp_path) == {"one": {"two"}, "three": set(), "two": {"one"}}


def test_no_benchmark_imports_another_in_a_circle():
    graph = import_graph()
    assert "common" in graph and not graph["common"], "benchmarks/common.py imports no other benchmark"
    found = cycles(graph)
    assert not found, f"benchmarks importing each other in a circle: {found}; move what they share to common.py"


def test_no_python_file_over_600_lines():
    found = long_files()
    assert not found, f"files over {MAX_LINES} lines (split them into plain-named modules): {found}"


def test_the_gpu_benchmark_starts_without_a_gpu_and_says_in_one_line_that_it_needs_one():
    script = [sys.executable, str(BENCH / "bench_gpu.py")]
    shown = subprocess.run([*script, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "--check" in shown.stdout and "--quick" in shown.stdout
    assert "PYTHONPATH=/tmp/site:. python3 benchmarks/bench_gpu.py --check" in shown.stdout  # the machine's command
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine with one
    ran = subprocess.run([*script, "--check", "--quick"], capture_output=True, text=True, timeout=300, env=env)
    assert ran.returncode == 1 and ran.stdout == ""
    assert ran.stderr.strip().startswith("bench_gpu.py needs a CUDA GPU") and "\n" not in ran.stderr.strip()


if __name__ == "__main__":
    graph = import_graph()
    for name, imported in graph.items():
        print(f"{name}: {', '.join(sorted(imported)) or '-'}")
    print("cycles:", cycles(graph) or "none")
    print(f"files over {MAX_LINES} lines:", long_files() or "none")
