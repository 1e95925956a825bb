"""The kernel check kit (``python -m vllm_specplug.kernels.check``): it runs
with vLLM hidden (and without Triton at all), and it catches a wrong kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCKER = """
import sys

class _Hidden:
    # any import of these packages fails, as on a machine without them
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden)")
        return None

sys.meta_path.insert(0, _Hidden())
"""


def _run_kit(tmp_path, blocked, *args):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER.format(blocked=blocked)))
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), REPO]),
           "TRITON_INTERPRET": "1"}
    probe = subprocess.run([sys.executable, "-c", "import vllm"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "hidden" in probe.stderr  # the blocker works
    # what the kit imports on a GPU (the EAGLE-3 check, the warm-up) imports too
    probe = subprocess.run([sys.executable, "-c", "import vllm_specplug.kernels.check_eagle3, "
                            "vllm_specplug.eagle3.runtime, vllm_specplug.kernels.warm_up"],
                           env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    proc = subprocess.run([sys.executable, "-m", "vllm_specplug.kernels.check", "--quick",
                           "--out", str(out), *args], env=env, capture_output=True,
                          text=True, timeout=900, cwd=str(tmp_path))
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_kit_runs_without_vllm(tmp_path):
    pytest.importorskip("triton", reason="the kit's kernel checks need Triton")
    proc, report = _run_kit(tmp_path, ["vllm"], "--jobs", "2")  # worker processes too
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["environment"]["vllm_importable"] is False
    assert report["environment"]["interpret"] is True
    kinds = {c["kernel"] for c in report["checks"]}
    assert kinds == {"tree_attention", "kv_move", "kv_move_caches", "adjacency_update",
                     "template_expand"}
    attention = [c for c in report["checks"] if c["kernel"] == "tree_attention"]
    assert {c["layout"] for c in attention} == {"NHD", "HND"}
    assert {c["dtype"] for c in attention} == {"float32", "float16"}
    assert {c["gqa"] for c in attention} == {1, 4}
    assert {c["segments"] for c in attention} == {1, 3}  # one pass, and split KV
    assert report["failed"] == 0 and all(c["ok"] for c in report["checks"])
    assert report["not_checked"]  # the interpreter's bfloat16 gap is reported


def test_kit_imports_without_triton(tmp_path):
    proc, report = _run_kit(tmp_path, ["vllm", "triton"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["kernels_skipped"] == "triton is not installed"
    assert report["checks"] == [] and report["failed"] == 0


def test_kit_catches_a_wrong_kernel(monkeypatch):
    pytest.importorskip("triton")
    from vllm_specplug.kernels import check, tree_attention

    # one output row off by 5 %: well above every dtype's tolerance
    def wrong(**batch):
        out = tree_attention.tree_attention_ref(**batch)
        out[0] *= 1.05
        return out

    monkeypatch.setattr(tree_attention, "tree_attention_triton", wrong)
    grid = dict(check.QUICK_GRID, head_dims=(16,), gqa=(2,), block_sizes=(16,),
                dtypes=("float32",), layouts=("NHD",), nodes=(3,), contexts=(5,))
    results = check.check_tree_attention(grid, "cpu")
    assert len(results) == 2 and not any(r["ok"] for r in results)  # one pass, split KV


def test_a_section_that_raises_is_a_miss_and_leaves_the_report():
    from vllm_specplug.kernels.check import guarded, misses

    report = {"checks": [{"kernel": "kv_move", "ok": True}], "timing": {}}
    guarded(report["timing"], "kv_move", lambda: 1 / 0)
    guarded(report, "warm_up", lambda: {"kernel": "warm_up_covers_serving", "ok": False})
    assert report["timing"]["kv_move"] == {"error": "ZeroDivisionError: division by zero"}
    assert len(misses(report)) == 2


def test_the_grid_draws_the_same_cases_however_it_is_shared():
    """A case is seeded by its place in the grid, not by the cases a worker
    ran before it: one worker and two give the same batches."""
    pytest.importorskip("triton")
    from vllm_specplug.kernels import check

    grid = dict(check.QUICK_GRID, head_dims=(16,), gqa=(2,), block_sizes=(16,),
                dtypes=("float32",), nodes=(3, 4), contexts=(5,))
    combos = check.attention_combos(grid)
    alone = check.check_attention_case(grid, 1, combos[1], "cpu")
    assert check.check_tree_attention(grid, "cpu")[2:4] == alone


@pytest.mark.parametrize("dtype,error,ok", [
    (torch.float32, 1e-5, True), (torch.float32, 1e-3, False),
    (torch.bfloat16, 1e-2, True), (torch.bfloat16, 1e-1, False),
    (torch.float16, 2e-3, True), (torch.float16, 2e-2, False),
])
def test_tolerance_per_dtype(dtype, error, ok):
    from vllm_specplug.kernels.check import compare

    want = torch.full((4, 2, 8), 0.5)
    got = want.clone()
    got[1, 1, 3] += error
    assert compare(got, want, dtype)["ok"] is ok


def test_eagle3_expansion_plumbing_on_cpu():
    """CPU against CPU (the GPU run compares CUDA against CPU): the trees are
    drafted at the reference head's shape and compared node by node."""
    from vllm_specplug.kernels.check_eagle3 import check_eagle3, compare_trees

    report = check_eagle3(quick=True, device="cpu")
    (result,) = report["checks"]
    assert result["ok"], result
    assert len(result["nodes"]) == 3 and all(n == 48 for n in result["nodes"])
    from vllm_specplug.engine.tree import DraftTree

    a = [DraftTree([5, 6], [-1, 0], [-0.1, -0.5])]
    assert not compare_trees(a, [DraftTree([5, 7], [-1, 0], [-0.1, -0.5])])["ok"]
    assert not compare_trees(a, [DraftTree([5, 6], [-1, 0], [-0.1, -0.6])])["ok"]
