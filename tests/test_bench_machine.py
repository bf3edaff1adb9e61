"""bench/machine.py names the machine of every benchmark page: the CPU's flags parsed from
/proc/cpuinfo, the header every page-writing bench script calls, and the README's quoted tables
carrying the machine line of the page they come from (scripts/sync_pages.py)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


machine = _load(REPO / "bench" / "machine.py", "bench_machine")

XEON_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu
"""
EPYC_ZEN4 = """processor\t: 0
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 avx512_vnni avx512vl
"""
ALDER_LAKE = """model name\t: 12th Gen Intel(R) Core(TM) i7-12700
flags\t\t: fpu avx avx2 avx_vnni
"""
ZEN2 = """model name\t: AMD EPYC 7B12
flags\t\t: fpu avx avx2 fma
"""


@pytest.mark.parametrize("cpuinfo, expected", [
    (XEON_AMX, {"AVX-512": True, "AVX512-BF16": True, "VNNI": True, "AMX-BF16": True, "AMX-INT8": True}),
    (EPYC_ZEN4, {"AVX-512": True, "AVX512-BF16": True, "VNNI": True, "AMX-BF16": False, "AMX-INT8": False}),
    (ALDER_LAKE, {"AVX-512": False, "AVX512-BF16": False, "VNNI": True, "AMX-BF16": False, "AMX-INT8": False}),
    (ZEN2, {"AVX-512": False, "AVX512-BF16": False, "VNNI": False, "AMX-BF16": False, "AMX-INT8": False}),
])
def test_cpu_flags_from_a_cpuinfo_flags_line(cpuinfo, expected):
    fields = machine.cpu_fields(cpuinfo)
    assert machine.cpu_flags(fields["flags"]) == expected
    described = machine.describe_cpu(cpuinfo, cores=2)
    model = fields["model name"]
    assert described == f"{model} (2 cores; " + ", ".join(
        f"{name} {'yes' if present else 'no'}" for name, present in expected.items()) + ")"


def test_the_first_processor_is_described_and_a_flag_is_a_whole_word():
    """The fields are the first processor's (its flags, not processor 1's `fpu`); `amx_tile` or a
    flag that only contains a name (`xavx512f`) is not that flag."""
    assert machine.cpu_flags(machine.cpu_fields(XEON_AMX)["flags"])["AMX-INT8"]
    assert machine.cpu_flags("flags : xavx512f avx512_bf16x amx_tile") == dict.fromkeys(machine.FEATURES, False)


def test_without_cpuinfo_the_description_says_the_flags_are_unknown():
    described = machine.describe_cpu("", cores=4)
    assert described.endswith("(4 cores; flags unknown)") and "yes" not in described


def test_the_header_names_the_machine_and_every_rooflines_dtype():
    kernels = {"mkl": 200.0, "onednn": 250.5, "onednn_bf16": 1696.0, "int_mm_int8": 3000.25}
    header = machine.page_header("cpu", 2, kernels)
    assert machine.is_header(header) and header.startswith("Machine: ")
    assert "2 threads, torch " in header and machine.describe_cpu() in header
    assert ("float32 **250.5** GFLOP/s (mkl 200.0, onednn 250.5); bfloat16 **1696.0** GFLOP/s (onednn_bf16 1696.0); "
            "int8 **3000.2** GOP/s (int_mm_int8 3000.2).") in header
    no_int8 = machine.page_header("cpu", 1, {"mkl": 10.0})
    assert "1 thread, " in no_int8 and "bfloat16" not in no_int8 and "int8" not in no_int8


def _page_writers() -> set[str]:
    """The bench scripts that write a page under bench/results/: those named in a page's title, and
    those whose code holds a `"results"` path part or defines a page writer (write_page, write_report,
    write_table, render)."""
    named = {word for page in (REPO / "bench" / "results").glob("*.md")
             for word in page.read_text(encoding="utf-8").splitlines()[0].replace("`", " ").split()
             if word.startswith("bench/") and word.endswith(".py")}
    writers = {f"bench/{Path(name).name}" for name in named}
    for script in (REPO / "bench").glob("*.py"):
        tree = ast.parse(script.read_text(encoding="utf-8"))
        strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
        functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        if "results" in strings or functions & {"write_page", "write_report", "write_table", "render"}:
            writers.add(f"bench/{script.name}")
    return writers


READERS = {"bench/gpu_time.py": "reads bench/results/train-cuda.md, writes docs/gpu.md"}


def _calls_page_header(script: Path) -> bool:
    tree = ast.parse(script.read_text(encoding="utf-8"))
    imported = any(isinstance(node, ast.ImportFrom) and node.module == "machine"
                   and any(alias.name == "page_header" for alias in node.names) for node in ast.walk(tree))
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    loaded = bool(strings & {"machine", "machine.py"})  # bench/machine.py loaded by its path (onnx.py, ray.py)
    called = any(isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == "page_header")
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "page_header")) for node in ast.walk(tree))
    return called and (imported or loaded)


def test_every_page_writing_bench_script_calls_the_header():
    writers = _page_writers() - set(READERS)
    assert {"bench/embed.py", "bench/train.py", "bench/serve.py", "bench/onnx.py", "bench/ray.py",
            "bench/fused_cell.py", "bench/embed_memory.py", "bench/bf16_task.py", "bench/int8_quality.py",
            "bench/train_cuda.py"} <= writers
    missing = sorted(name for name in writers if not _calls_page_header(REPO / name))
    assert not missing, f"bench scripts that write a page without bench/machine.py's page_header: {missing}"


def test_the_static_check_finds_a_script_that_names_its_own_machine(tmp_path):
    """The check itself: a page writer with its own machine line is caught; calling the header passes."""
    script = tmp_path / "bench" / "mine.py"
    script.parent.mkdir()
    script.write_text('import platform\ndef write_page():\n    return f"Machine: {platform.machine()}"\n')
    assert not _calls_page_header(script)
    script.write_text('from machine import page_header\ndef write_page():\n    return page_header("cpu", 2)\n')
    assert _calls_page_header(script)


def test_a_quoted_bench_table_carries_its_pages_machine(tmp_path, monkeypatch):
    """scripts/sync_pages.py: under a table of a bench page, that page's header line; for a page
    written before the header existed, a note that says so and quotes the page's own line."""
    sync = _load(REPO / "scripts" / "sync_pages.py", "sync_pages_for_machine")
    header = machine.page_header("cpu", 2, {"mkl": 100.0, "onednn_bf16": 400.0})
    (tmp_path / "bench" / "results").mkdir(parents=True)
    new = tmp_path / "bench" / "results" / "new.md"
    new.write_text(f"# Speed (`bench/new.py`)\n\n{header}\n\n| a | b |\n|---|---|\n| 1 | 2 |\n", encoding="utf-8")
    old = tmp_path / "bench" / "results" / "old.md"
    old.write_text("# Speed (`bench/old.py`)\n\nMachine: x86_64, 2 cores. More.\n\n| a |\n|---|\n| 3 |\n",
                   encoding="utf-8")
    monkeypatch.setattr(sync, "REPO", tmp_path)
    monkeypatch.setattr(sync, "_bench_machine", lambda: machine)
    readme = ("<!-- table: bench/results/new.md 1 -->\nstale\n<!-- /table -->\n"
              "<!-- table: bench/results/old.md 1 -->\nstale\n<!-- /table -->\n")
    synced = sync.synced(readme)
    assert (f"| 1 | 2 |\n\nMeasured on: {header.removeprefix('Machine: ')} (`bench/results/new.md`)\n"
            "<!-- /table -->") in synced
    assert "`bench/results/old.md` predates bench/machine.py's header" in synced
    assert 'Its own line: "Machine: x86_64, 2 cores."' in synced
    edited = synced.replace("**100.0**", "**900.0**")
    assert edited != synced and sync.synced(edited) == synced


def test_the_readme_quotes_each_bench_tables_machine_line():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for source in ("embed.md", "train.md", "onnx.md", "serve.md"):
        block = text[text.index(f"<!-- table: bench/results/{source} 1 -->"):]
        block = block[:block.index("<!-- /table -->")]
        assert f"(`bench/results/{source}`)" in block or f"`bench/results/{source}` predates" in block, source
