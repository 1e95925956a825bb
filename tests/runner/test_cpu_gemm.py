"""A drafter's linear layers on vLLM's CPU GEMM kernels (runner/cpu_gemm.py)."""

import torch

from vllm_specplug.runner.cpu_gemm import prepare_cpu_linears


def test_routed_linears_compute_what_torch_computes():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.SiLU(),
                              torch.nn.Linear(1536, 12288, bias=True))
    xs = [torch.randn(1, 576), torch.randn(10, 576), torch.randn(2, 5, 576)]
    want = [net(x) for x in xs]
    assert prepare_cpu_linears(net) == 2
    # vLLM's kernel, not torch's: the layer now goes through cpu_linear
    assert all(hasattr(m, "cpu_linear") for m in net if isinstance(m, torch.nn.Linear))
    for x, w in zip(xs, want):
        got = net(x)
        assert got.shape == w.shape
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)
    # the weights stay readable (state dicts, training code)
    assert net[2].weight.shape == (12288, 1536)
