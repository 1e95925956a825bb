"""The CPU linear kernel (kernels/cpu_linear.cpp): its values against a
float64 matmul, its bits against vLLM's own oneDNN dispatch (the promise
that routing a layer changes no token), inside ``torch.compile``, and the
routing's refusals. Built twice, like the tree kernel: this machine's
instruction set and AVX2 only."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.conftest import onednn_order_unknown_here
from vllm_specplug.kernels import cpu_linear

# the reference model's linear shapes (K, N): qkv, o, gate_up, down, LM head
REFERENCE_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


@pytest.fixture(scope="module", autouse=True, params=["native", "x86-64-v3"])
def _build(request, tmp_path_factory):
    assert cpu_linear.ensure_loaded(), cpu_linear._error
    saved = cpu_linear._lib, dict(cpu_linear._checked)
    if request.param != "native":
        cpu_linear._lib = cpu_linear.open_library(
            cpu_linear.build(str(tmp_path_factory.mktemp("ext")), request.param))
    cpu_linear._checked.clear()  # the other build's verdicts do not carry over
    try:
        yield request.param
    finally:
        cpu_linear._lib, checked = saved
        cpu_linear._checked.clear()
        cpu_linear._checked.update(checked)


def _vllm_linear(k: int, n: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    """A layer prepared by vLLM's own CPU dispatch (oneDNN here), weights kept."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    torch.manual_seed(seed)
    layer = torch.nn.Linear(k, n, bias=bias)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return layer


@pytest.mark.parametrize("k,n,block", [(576, 960, 0), (100, 48, 0), (1536, 576, 0),
                                       (1536, 576, 1024), (129, 96, 0), (129, 96, 50),
                                       (2100, 48, 1024)])
def test_values_match_float64(k, n, block):
    """K not a multiple of the k chunk, N a few panels, summed blocks that
    do and do not line up with the k chunks: every row count up to MAX_ROWS
    against float64 (the yardstick is not the kernel)."""
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=g)
    if n % cpu_linear.panel():
        pytest.skip("N is not a multiple of this build's panel")
    packed = cpu_linear.pack(w)
    for m in range(1, cpu_linear.MAX_ROWS + 1):
        x = torch.randn(m, k, generator=g)
        got = cpu_linear.matmul(x, packed, n, block).double()
        want = x.double() @ w.double().T
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * k ** 0.5), m


@pytest.mark.parametrize("k,n", REFERENCE_SHAPES)
def test_routed_layers_keep_onednn_bits(k, n):
    """A routed layer and an unrouted twin (same weights, vLLM's dispatch)
    give the same bits for every row count, on inputs the routing's own
    check never saw; calls past MAX_ROWS go to vLLM's path. Shapes whose
    oneDNN order differs from the kernel's are refused, not routed."""
    twin = _vllm_linear(k, n)
    layer = _vllm_linear(k, n)
    routed = cpu_linear.route(layer, layer.weight)
    if not routed:
        assert cpu_linear._checked[(k, n)] is None, "refused for another reason"
        assert layer.cpu_linear.__code__ is twin.cpu_linear.__code__  # still vLLM's
        return
    g = torch.Generator().manual_seed(7)
    for m in list(range(1, cpu_linear.MAX_ROWS + 1)) + [cpu_linear.MAX_ROWS + 1, 64]:
        x = torch.randn(m, k, generator=g) * 3
        a = layer.cpu_linear(x, layer.weight, None)
        b = twin.cpu_linear(x, twin.weight, None)
        assert torch.equal(a, b), m


def _onednn_order_known() -> None:
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("oneDNN's order is only known for x86")
    if onednn_order_unknown_here():
        pytest.skip("oneDNN's order on this CPU is not one the kernel knows (shapes refused)")


def test_the_reference_models_small_shapes_route_on_x86():
    """On x86 oneDNN sums K = 576 in blocks the check finds: those layers
    (3/4 of the reference model's weights with its LM head) take the
    kernel. If this fails on some CPU, the kernel is merely unused there,
    never wrong."""
    _onednn_order_known()
    layer = _vllm_linear(576, 960)
    assert cpu_linear.route(layer, layer.weight)


def test_the_down_projection_routes_with_onednns_blocks_on_x86():
    """oneDNN sums K = 1536 in blocks (AVX2: k < 1024 and k >= 1024 at every
    row count; AVX-512: blocks of 512 at one row, of 1024 at more): the
    check finds that order per row count, so the reference model's down
    projections route too; and the plain one-chain order is indeed not
    oneDNN's there (else the block search would prove nothing)."""
    _onednn_order_known()
    layer = _vllm_linear(1536, 576, seed=5)
    assert cpu_linear.route(layer, layer.weight)
    blocks = cpu_linear._checked[(1536, 576)]
    assert len(blocks) == cpu_linear.MAX_ROWS and set(blocks[1:]) == {1024}
    assert blocks[0] in (512, 1024)
    x = torch.randn(4, 1536)
    packed = cpu_linear.pack(layer.weight)
    assert not torch.equal(cpu_linear.matmul(x, packed, 576, 0),
                           layer.cpu_linear(x, layer.weight, None))


def test_one_block_for_every_row_count_is_not_always_onednns():
    """Where oneDNN's block changes with the rows (AVX-512, K = 1536: 512 at
    one row, 1024 at more), the kernel with either block alone differs from
    oneDNN at some row count: the per-row-count search is needed, and
    finds an order the single-block search could not."""
    _onednn_order_known()
    layer = _vllm_linear(1536, 576, seed=6)
    assert cpu_linear.route(layer, layer.weight)
    blocks = cpu_linear._checked[(1536, 576)]
    if len(set(blocks)) == 1:
        pytest.skip("oneDNN keeps one block at every row count on this CPU")
    packed = cpu_linear.pack(layer.weight)
    g = torch.Generator().manual_seed(11)
    for block in set(blocks):
        differs = False
        for m in (1, 2, 8):
            x = torch.randn(m, 1536, generator=g)
            differs |= not torch.equal(cpu_linear.matmul(x, packed, 576, block),
                                       layer.cpu_linear(x, layer.weight, None))
        assert differs, block


def test_more_rows_than_the_kernel_takes_are_refused():
    packed = cpu_linear.pack(torch.randn(48, 64))
    with pytest.raises(ValueError, match="rows"):
        cpu_linear.matmul(torch.randn(cpu_linear.MAX_ROWS + 1, 64), packed, 48)


def test_inside_torch_compile():
    """The op is opaque to dynamo and inductor, with dynamic row counts, and
    reads the layer's handle at run time."""
    layer = _vllm_linear(576, 576, seed=3)
    if not cpu_linear.route(layer, layer.weight):
        pytest.skip("shape refused on this CPU")
    f = torch.compile(lambda x: layer.cpu_linear(x, layer.weight, None) * 2, dynamic=True)
    for m in (1, 9, 40):
        x = torch.randn(m, 576)
        assert torch.equal(f(x), layer.cpu_linear(x, layer.weight, None) * 2)


def test_refusals():
    """Bias, other dtypes, N off the panel: left to vLLM."""
    with_bias = _vllm_linear(576, 576, bias=True)
    assert not cpu_linear.route(with_bias, with_bias.weight)
    odd = _vllm_linear(576, cpu_linear.panel() + 1)
    assert not cpu_linear.route(odd, odd.weight)
    bf16 = _vllm_linear(576, 576).to(torch.bfloat16)
    assert not cpu_linear.route(bf16, bf16.weight)


def _first_dispatch_done() -> None:
    # The process's first vLLM dispatch imports lazily, and the import
    # machinery keeps that call's frame (and so its layer) alive: run one
    # before counting what the table keeps.
    _vllm_linear(64, 64)
    gc.collect()


def test_entries_go_with_their_layer():
    """Tests and benchmarks start many engines in one process: a dropped
    layer's packed copy must go with it."""
    _first_dispatch_done()
    before = len(cpu_linear._layers)
    layer = _vllm_linear(576, 960)
    if not cpu_linear.route(layer, layer.weight):
        pytest.skip("shape refused on this CPU")
    assert len(cpu_linear._layers) == before + 1
    del layer
    gc.collect()
    assert len(cpu_linear._layers) == before


def test_entries_go_with_a_layer_whose_weight_points_back_to_it():
    """vLLM keeps the weight of its (tied) embedding / LM head, a Parameter
    whose ``weight_loader`` is a bound method of the layer: the table must
    not keep that Parameter, or the layer (and its packed copy, ~0.4 GB on
    the reference model) outlives every engine, and a process that starts
    many engines runs out of memory."""
    _first_dispatch_done()
    before = len(cpu_linear._layers)
    layer = _vllm_linear(576, 960)
    layer.weight.weight_loader = layer.extra_repr  # a bound method, as vLLM sets
    if not cpu_linear.route(layer, layer.weight):
        pytest.skip("shape refused on this CPU")
    assert len(cpu_linear._layers) == before + 1
    del layer
    gc.collect()
    assert len(cpu_linear._layers) == before
