"""Growing an EAGLE-3 data folder without regenerating finished shards."""

import json
import os

from vllm_specplug.eagle3.data import _extend_prompts


def _p(i):
    return {"id": f"x/{i}", "source": "file", "turns": [f"q{i}"]}


def test_extend_keeps_full_shards_and_redoes_the_partial_one(tmp_path):
    d = tmp_path
    (d / "gen").mkdir()
    old = [_p(i) for i in range(5)]  # shards of 2: [0,1] [2,3] [4]
    for c in range(3):
        (d / "gen" / f"chunk_{c:05d}.jsonl").write_text("{}\n")
        (d / f"shard_{c:05d}.safetensors").write_bytes(b"x")
    out = _extend_prompts(str(d), old, [_p(3), _p(4), _p(5), _p(6)], 2, None)
    assert [p["id"] for p in out] == [f"x/{i}" for i in range(7)]
    assert (d / "gen" / "chunk_00001.jsonl").exists() and (d / "shard_00001.safetensors").exists()
    assert not (d / "gen" / "chunk_00002.jsonl").exists()
    assert not (d / "shard_00002.safetensors").exists()
    saved = [json.loads(line) for line in open(d / "prompts.jsonl")]
    assert saved == out


def test_extend_with_nothing_new_touches_nothing(tmp_path):
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "chunk_00000.jsonl").write_text("{}\n")
    old = [_p(0)]
    assert _extend_prompts(str(tmp_path), old, [_p(0)], 2, None) == old
    assert os.path.exists(tmp_path / "gen" / "chunk_00000.jsonl")
    assert not os.path.exists(tmp_path / "prompts.jsonl")
    # a cap on the total number of prompts
    out = _extend_prompts(str(tmp_path), old, [_p(1), _p(2), _p(3)], 4, 3)
    assert len(out) == 3
