"""benchmarks/device_work.py: a step's kernels, arithmetic and traffic counted on the CPU for a GPU estimate."""

import json

import pytest
import torch

from conftest import REPO, run_tool
from test_gpu_scripts import load_benchmark


@pytest.mark.parametrize("op, kernel", [
    (torch.ops.aten.view.default, False),
    (torch.ops.aten.transpose.int, False),
    (torch.ops.aten.empty.memory_format, False),
    (torch.ops.aten.add.Tensor, True),
    (torch.ops.aten.add_.Tensor, True),  # in place: writes its input
    (torch.ops.aten.index_select.default, True),
    (torch.ops.aten.bmm.default, True),
])
def test_what_launches_a_kernel(op, kernel):
    assert load_benchmark("device_work").launches(op) is kernel


@pytest.mark.parametrize("runner", ["lean", "static", "static-indexed"])
def test_a_stacked_two_member_step_on_the_cuda_path(tmp_path, runner):
    """Two random Multi30k-shaped members stacked, 4 sentences at k=5: the products run batched (two members'
    arithmetic in each), the table prints every kind and the output layer's read."""
    out = tmp_path / "work.json"
    proc = run_tool(["python", REPO / "benchmarks" / "device_work.py", "--runner", runner, "--shape", "m30k",
                     "--members", "2", "--sentences", "4", "--first", "2", "--steps", "2", "--json", out])
    result = json.loads(out.read_text())
    # (The static step's rows: the reserved 20 are a bucket of their own.)
    assert result["stacked"] and result["rows"] == 20 and result["runner"] == runner
    kinds = {k["kind"]: k for k in result["kinds"]}
    products = kinds["products"]
    # 3 decoder layers of 256 dims (FFN 512), 2 members, 20 rows: at least the FFN's 2 * 2 * 20 * 256 * 512 * 2
    # flops a layer, and the output layer's 2 * 2 * 20 * 256 * 8000.
    assert products["gflop_per_call"] * 1e9 >= 3 * 2 * 2 * 20 * 256 * 512 * 2 + 2 * 2 * 20 * 256 * 8000
    # Batched, not a launch per member: a layer's 6 products and 4 attention bmms, and the output projection.
    assert products["kernels_per_call"] <= 3 * (6 + 4) + 1
    assert kinds["output layer (one read of the logits)"]["gb_per_call"] * 1e9 == 2 * 20 * 8000 * 2
    assert "| products |" in proc.stdout and "| all |" in proc.stdout
    if runner == "static-indexed":  # CUDA's attention: one kernel each, 2 a layer, no gathers of the caches;
        # and the reorder's slot copy, one kernel (the stacked members' one cache)
        assert kinds["ours"]["kernels_per_call"] == 2 * 3 + 1
        assert "aten::index_select" not in [c["op"] for c in result["costliest"][:3]]
