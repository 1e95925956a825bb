"""The relaxed-verification sweep's grid and table (the runs are benchmarks)."""

from __future__ import annotations

from benchmarks.studies import respec_relaxed
from benchmarks.run import lossy_by_option


def test_grid_labels_turn_the_lossy_option_on_only_for_relaxed_points():
    opts = respec_relaxed.grid_options([0.0, 1.5], [1, 2], {"cost_aware": False})
    assert opts["respec"] == {"cost_aware": False}
    assert set(opts) == {"respec", "respec@t0-m1", "respec@t1.5-m1", "respec@t0-m2",
                         "respec@t1.5-m2"}
    assert opts["respec@t1.5-m2"] == {"cost_aware": False, "relaxed_lossy": True,
                                     "relaxed_tau_nats": 1.5, "relaxed_m": 2}
    # The harness fails a lossless check for strict respec, reports the others.
    assert not lossy_by_option(opts["respec"])
    assert all(lossy_by_option(o) for k, o in opts.items() if k != "respec")


def test_table_reads_the_grid_back():
    opts = respec_relaxed.grid_options([2.0], [3], {})
    doc = {"run": {"methods": [{"name": k, "options": v} for k, v in opts.items()]
                   + [{"name": "none", "options": {}}]},
           "records": [
               {"method": "none", "suite": "s", "batch_size": 8, "status": "ok", "tau": 1.0,
                "token_match_rate": 1.0, "identical_fraction": 1.0},
               {"method": "respec", "suite": "s", "batch_size": 8, "status": "ok", "tau": 2.0,
                "token_match_rate": 1.0, "identical_fraction": 1.0},
               {"method": "respec@t2-m3", "suite": "s", "batch_size": 8, "status": "ok",
                "tau": 2.5, "token_match_rate": 0.75, "identical_fraction": 0.5}]}
    rows = respec_relaxed.table(doc)
    assert [(r["method"], r["relaxed"], r["tau_nats"], r["m"]) for r in rows] == [
        ("respec", False, None, None), ("respec@t2-m3", True, 2.0, 3)]
    assert rows[1]["token_match_rate"] == 0.75
