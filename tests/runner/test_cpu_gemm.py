"""A drafter's linear layers on vLLM's CPU GEMM kernels (runner/cpu_gemm.py)."""

import torch

from tests.conftest import onednn_order_unknown_here
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


def test_bfloat16_weights_compute_the_rounded_weights_product():
    # a drafter asking for bfloat16 weights gets what a bfloat16 GEMM of its
    # inputs and weights gives, returned in float32; the float32 weights
    # stay the layer's (state dicts, training)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.SiLU(),
                              torch.nn.Linear(1536, 960, bias=True))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert prepare_cpu_linears(net, weight_dtype=torch.bfloat16) == 2
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    for x in (torch.randn(1, 576), torch.randn(10, 576), torch.randn(2, 5, 576)):
        got = net(x)
        assert got.dtype == torch.float32 and got.shape == (*x.shape[:-1], 960)
        h = x.bfloat16().float() @ before["0.weight"].bfloat16().float().T
        h = torch.nn.functional.silu(h.bfloat16().float())
        want = (h.bfloat16().float() @ before["2.weight"].bfloat16().float().T
                + before["2.bias"].bfloat16().float())
        # bfloat16 keeps 8 bits of mantissa: outputs within a few of its steps
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
        # and not the float32 product: the rounding shows
        exact = torch.nn.functional.linear(
            torch.nn.functional.silu(x @ before["0.weight"].T),
            before["2.weight"], before["2.bias"])
        assert (got - exact).abs().max() > 1e-4


def test_only_a_specplug_load_routes_to_the_linear_kernel(monkeypatch):
    """Inside ``cpu_linear_routing`` (the specplug runner's model loading)
    vLLM's dispatch hands float32 layers to the small-row kernel; after it,
    a plain engine's layers in the same process stay vLLM's (its compile
    cache key knows nothing of the kernel)."""
    import vllm.model_executor.layers.utils as vllm_utils

    from vllm_specplug.kernels import cpu_linear
    from vllm_specplug.runner.cpu_gemm import cpu_linear_routing

    if onednn_order_unknown_here():
        # The order check may refuse every shape here (oneDNN's order on an
        # AMD CPU with AVX-512 is unknown; tests/kernels covers refusals). This test
        # is about *where* routing happens, so the check is told to pass.
        monkeypatch.setattr(cpu_linear, "sum_blocks",
                            lambda *args: (0,) * cpu_linear.MAX_ROWS)
        # and forgets refusals cached by earlier tests in this process
        monkeypatch.setattr(cpu_linear, "_checked", {})

    def prepared(k=576, n=960):
        layer = torch.nn.Linear(k, n, bias=False)
        # looked up at call time, as vLLM's linear layers do
        vllm_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        return layer

    with cpu_linear_routing() as on:
        assert on, cpu_linear._error
        inside = prepared()
        assert cpu_linear.take_routed() == ["576x960"]
    outside = prepared()
    assert cpu_linear.take_routed() == []
    assert inside.cpu_linear.__code__ is not outside.cpu_linear.__code__  # vLLM's lambda
    x = torch.randn(3, 576)
    assert inside.weight.numel() == 0  # vLLM dropped the weight; the kernel has its copy
    assert inside.cpu_linear(x, inside.weight, None).shape == (3, 960)
    with cpu_linear_routing(on=False) as on:
        assert not on
