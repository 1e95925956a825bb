"""The machine record every benchmark JSON carries, and the compiled default."""

from __future__ import annotations

from benchmarks import machine, run

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx f16c fma avx2 bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx f16c fma avx2 bmi2
"""


def test_cpu_model_and_flags():
    model, flags = machine.cpu_info(EPYC)
    assert model == "AMD EPYC 7B13"
    assert flags == ["avx", "avx2", "bmi2", "f16c", "fma", "fpu", "sse4_2"]
    assert machine.cpu_info("") == (None, [])


def test_machine_info_here():
    info = machine.machine_info()
    assert info["cpu_count"] >= 1 and info["python"]
    if info.get("cpu_flags"):  # Linux
        assert set(info["isa"]) <= set(info["cpu_flags"])
        assert isinstance(info["native_bf16"], bool)
    line = machine.describe(info)
    assert line.startswith("machine: ") and "ISA: " in line


def test_benchmarks_run_compiled_by_default():
    assert run.parse_args([]).eager is False
    assert run.parse_args(["--eager"]).eager is True
    assert run.compile_cache_dir().endswith("torch_compile_cache")
