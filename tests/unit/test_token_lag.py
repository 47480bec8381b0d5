"""`benchmarks/token_lag.py`: the exact token-lag histogram of a run from its rollout dumps, and its percentiles.
Expected values are counted by hand from the records below."""

from __future__ import annotations

import json

from benchmarks import token_lag as tl

# trained version 6 (lag_max 3 + oldest version 3): 10 tokens of version 3 (lag 3), 5 of version 5 (lag 1)
SPANNING = {"versions": [[0, 9, 3], [10, 14, 5]], "lag_max": 3}
# a multi-turn sample: 3 environment tokens (version -1, no lag); trained version 4 (2 + 2): 5 tokens at lag 2,
# 2 at lag 0
MULTI_TURN = {"versions": [[0, 4, 2], [5, 7, -1], [8, 9, 4]], "lag_max": 2}


def test_a_record_s_tokens_are_counted_per_lag_from_its_own_trained_version():
    assert tl.record_lags(SPANNING) == {3: 10, 1: 5}
    assert tl.record_lags(MULTI_TURN) == {2: 5, 0: 2}  # the environment's tokens are not counted
    assert tl.record_lags({"versions": [[0, 3, -1]], "lag_max": 0}) == {}


def test_the_histogram_sums_records_and_its_percentiles_are_nearest_rank():
    hist = tl.histogram([SPANNING, MULTI_TURN])
    assert hist == {0: 2, 1: 5, 2: 5, 3: 10} and list(hist) == [0, 1, 2, 3]
    # 22 tokens; cumulative 2, 7, 12, 22: half (11) is first reached at lag 2, 90% (19.8) at lag 3
    assert tl.percentile(hist, 0.5) == 2 and tl.percentile(hist, 0.9) == 3
    assert tl.percentile({0: 9, 5: 1}, 0.9) == 0 and tl.percentile({0: 9, 5: 1}, 0.91) == 5
    assert tl.percentile({}, 0.5) is None
    s = tl.lag_summary(hist)
    assert (s["p50"], s["p90"], s["max"], s["tokens"]) == (2, 3, 3, 22)
    assert s["hist"] == {"0": 2, "1": 5, "2": 5, "3": 10}


def test_seeds_merge_with_keys_read_back_from_json():
    merged = tl.merge([{"0": 2, "3": 1}, {0: 1, 1: 4}])
    assert merged == {0: 3, 1: 4, 3: 1}
    assert tl.lag_summary(merged)["max"] == 3 and tl.lag_summary({})["max"] is None


def test_dumps_are_read_step_by_step_from_the_run_s_rollouts_folder(tmp_path):
    assert list(tl.read_dumps(tmp_path)) == []  # a run without dumps
    folder = tmp_path / "rl" / "rollouts"
    folder.mkdir(parents=True)
    (folder / "step-0000002.jsonl").write_text(json.dumps(MULTI_TURN) + "\n")
    (folder / "step-0000001.jsonl").write_text(json.dumps(SPANNING) + "\n\n")
    assert list(tl.read_dumps(tmp_path)) == [SPANNING, MULTI_TURN]
