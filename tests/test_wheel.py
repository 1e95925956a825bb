"""The built wheel works on its own: installed into a fresh virtual
environment that has the runtime dependencies but not this source tree,
every ``specplug`` command answers ``--help``, and a real
``specplug reader optimize-tree`` run calibrates on a built-in suite (no
``benchmarks/`` folder to lean on)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.wheel, pytest.mark.engine]

REPO = Path(__file__).resolve().parents[1]
HELP_COMMANDS = [
    [], ["ref-model"], ["tiny-model"], ["serve"], ["methods"],
    ["adjacency"], ["adjacency", "build"], ["adjacency", "info"],
    ["datastore"], ["datastore", "build-dense"], ["datastore", "build-sa"],
    ["datastore", "info"], ["eagle3"], ["eagle3", "generate-data"], ["eagle3", "train"],
    ["graft"], ["graft", "calibrate"], ["reader"], ["reader", "optimize-tree"], ["selftest"],
]
PACKAGE_DATA = ["vllm_specplug/eagle3/heads/smollm2-135m-instruct/model.safetensors",
                "vllm_specplug/eagle3/heads/smollm2-135m-instruct/config.json",
                "vllm_specplug/kernels/cpu_tree_attention.cpp",
                "vllm_specplug/kernels/cpu_linear.cpp"]


def _run(cmd, cwd, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.args, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps`` of a copy of the source (the checkout stays clean)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "checkpoint", "*.egg-info")
    shutil.copytree(REPO / "vllm_specplug", src / "vllm_specplug", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
              "--wheel-dir", root / "dist", src], cwd=root))
    (built,) = (root / "dist").glob("vllm_specplug-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh environment: the running one's packages as a plain path (so
    its editable install of this checkout is not loaded), the wheel on top."""
    env = tmp_path_factory.mktemp("venv") / "env"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", env], cwd=env.parent))
    python = env / "bin" / "python"
    site = _ok(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=env.parent)).strip()
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(site, "dependencies.pth").write_text("".join(f"{d}\n" for d in deps))
    _ok(_run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
              "--no-index", wheel], cwd=env.parent))
    return env


def test_wheel_holds_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in PACKAGE_DATA if n not in names]
    assert not missing, f"not in the wheel: {missing} (pyproject.toml package-data)"
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names)


def test_installed_package_is_the_wheel(venv):
    code = ("import importlib.util, vllm_specplug; print(vllm_specplug.__file__); "
            "print(importlib.util.find_spec('benchmarks'))")
    package, benchmarks = _ok(_run([venv / "bin" / "python", "-c", code],
                                   cwd=venv.parent)).split()
    assert Path(package).is_relative_to(venv), package
    assert benchmarks == "None"  # the repository's benchmarks/ is out of reach


@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: " ".join(c) or "specplug")
def test_every_command_answers_help(venv, command):
    proc = _run([venv / "bin" / "specplug", *command, "--help"], cwd=venv.parent)
    _ok(proc)
    assert "usage:" in proc.stdout
    assert "skipping" not in proc.stderr, proc.stderr  # a subcommand failed to register


def test_optimize_tree_runs_from_the_wheel(venv, tiny_model):
    work = venv.parent
    cost = work / "verify_cost.json"
    cost.write_text(json.dumps({"records": [
        {"batch_size": 1, "tree_size": n, "step_ms": 10.0 + n} for n in (0, 4, 8, 16)]}))
    out = work / "shape.json"
    proc = _run([venv / "bin" / "specplug", "reader", "optimize-tree", "--cost", cost,
                 "--out", out, "--model", tiny_model, "--method", "recycle",
                 "--seed", "4,2", "--suites", "humaneval:even", "--limit", "2",
                 "--max-tokens", "8"], cwd=work, timeout=600)
    printed = json.loads(_ok(proc).strip().splitlines()[-1])
    assert printed["prompts"] == 2 and printed["steps"] > 0
    assert json.loads(out.read_text())  # the template file, loadable as `template`
