"""Loading for large models: each FSDP2 rank reads only its own shard of every tensor from the safetensors files."""

import json
import re

import pytest

from conftest import ROOT, torchrun_script


@pytest.mark.slow
def test_each_rank_loads_only_its_shard(tmp_path):
    r = torchrun_script(2, ROOT / "tests" / "dist" / "sharded_load.py", str(tmp_path / "model"), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    # the ranks' lines may interleave on the shared stdout
    results = [json.loads(m) for m in re.findall(r"RESULT (\{.*?\})", r.stdout)]
    assert len(results) == 2
    for res in results:
        assert res["files"] >= 4 and res["equal"], res
        # its half of the fp32 model plus one tensor's read buffer (measured: 275 MB of a 384 MB model); reading
        # the whole model, as before, grows by the model and the shard together (> 1.5x)
        assert res["peak_growth_mb"] < 0.85 * res["model_mb"], res
        # and the measurement sees the load at all: each rank holds its half (rank 0's peak was once read after its
        # own model build had set the high-water mark; the peak is now reset before the load)
        assert res["peak_growth_mb"] > 0.4 * res["model_mb"], res
