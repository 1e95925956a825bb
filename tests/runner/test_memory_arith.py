"""runner/memory.py: the reservation's arithmetic, against values worked
out by hand."""

from __future__ import annotations

from vllm_specplug.engine.verify import request_chunks
from vllm_specplug.runner import memory
from vllm_specplug.runner.memory import (
    MIB,
    Reservation,
    StepShape,
    chunk_rows,
    doubled_tokens,
    head_state_items,
    host_shortfall,
    step_items,
    tree_rows,
)


def test_chunk_rows():
    assert chunk_rows(1000, 40_000) == 10  # 40 kB / (4 B x 1000)
    assert chunk_rows(1000, 43_999) == 10
    assert chunk_rows(10**9, 1) == 1  # never below one row
    # the default: 32 MiB of float32 over a 150k vocabulary -> 55 rows
    assert memory.CHUNK_BYTES == 32 * MIB
    assert chunk_rows(151_936) == 55


def test_tree_rows_bounded_by_the_steps_tokens():
    assert tree_rows(256, 16, 8192) == 4352  # 256 x 17
    assert tree_rows(256, 16, 2048) == 2048
    assert tree_rows(1, 0, 8192) == 1


def test_request_chunks_keep_requests_whole():
    assert request_chunks([3, 3, 3, 5, 1], 6) == [[0, 1], [2], [3, 4]]
    assert request_chunks([7, 1], 6) == [[0], [1]]  # one request above the bound
    assert request_chunks([], 6) == []


def test_step_items_small_shape():
    s = StepShape(max_num_seqs=4, num_speculative_tokens=3, max_num_batched_tokens=100,
                  vocab=10, logits_bytes=4)
    assert s.rows == 16 and s.chunk == 16
    assert step_items(s) == {
        "logits": 16 * 10 * 4,               # 640
        "path rows": 16 * 10 * (4 + 4),      # 1280
        "rejection sampler": 16 * 10 * 32,   # 5120
        "row chunks": 16 * 10 * 32,          # max(32, 16 + 4) per element
    }


def test_step_items_chunk_bounds_the_row_work():
    # 4096 rows of a 131072 vocabulary in bfloat16: chunk = 32 MiB / 512 kB = 64
    s = StepShape(256, 15, 8192, 131_072, 2)
    assert s.rows == 4096 and s.chunk == 64
    items = step_items(s)
    assert items["row chunks"] == 64 * 131_072 * 32  # 256 MiB, not 16 GiB
    assert items["logits"] == 4096 * 131_072 * 2


def test_head_state_items():
    assert head_state_items(4, 100, 512, None, 3200, 10, 12) == {
        "head K/V": 4 * 512 * 100, "head prefix store": 3200, "held rows": 4 * 10 * 12}
    # a global cap below every request's own
    assert head_state_items(4, 100, 512, 1000, 0, 0, 12)["head K/V"] == 1000
    # held rows: 4 x 10 x 12 = 480 per the requests' own bound, 300 overall
    assert head_state_items(4, 100, 512, None, 0, 10, 12, 300)["held rows"] == 300
    assert head_state_items(4, 100, 512, None, 0, 10, 12, 10**6)["held rows"] == 480


def test_doubled_tokens():
    assert doubled_tokens(100) == 256
    assert doubled_tokens(1024) == 1024
    assert doubled_tokens(1025) == 2048


def test_reservation_line():
    r = Reservation({"logits": MIB, "b": MIB // 2, "c": 0})
    assert r.total == MIB + MIB // 2
    assert r.own == MIB // 2  # logits: vLLM's chain verification has them too
    assert r.line() == ("specplug reserves 1.5 MiB for drafting (0.5 MiB beyond vLLM's "
                        "chain verification): logits 1.0 MiB, b 0.5 MiB")
    assert Reservation().line().endswith(": nothing")


def test_host_shortfall():
    # room = 1000 - 800 = 200; half of it is 100
    assert host_shortfall(100, 1000, 800, 0.5) is None
    msg = host_shortfall(101, 1000, 800, 0.5)
    assert msg is not None and "\n" not in msg and "VLLM_CPU_KVCACHE_SPACE" in msg
    assert host_shortfall(1, 100, 800, 0.5) is not None  # KV cache above what is free
