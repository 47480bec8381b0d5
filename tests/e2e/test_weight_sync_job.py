"""Weight sync: a bit-exact FSDP2 -> inference-rank broadcast under torchrun."""

import pytest

from conftest import ROOT, torchrun_script


@pytest.mark.slow
def test_fsdp_to_inference_broadcast_is_bit_exact():
    r = torchrun_script(3, ROOT / "tests" / "dist" / "weight_sync.py", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "WEIGHT_SYNC_OK" in r.stdout


@pytest.mark.slow
def test_a_single_trainer_sends_whole_one_tensor_buckets_from_the_parameters_bit_exact():
    r = torchrun_script(2, ROOT / "tests" / "dist" / "weight_sync.py", "1", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "WEIGHT_SYNC_OK" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("bucket", ["1", str(64 * 1024**2)])
def test_an_overlapped_push_is_bit_exact_and_times_the_receivers_transfer(bucket):
    """rl.overlap_push: the trainer goes on while the engine takes the update (one bucket: the push returns at
    once); the parameters sent as they are (1-byte buckets) change only after `finish`."""
    r = torchrun_script(2, ROOT / "tests" / "dist" / "weight_sync.py", bucket, "overlap", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "WEIGHT_SYNC_OK" in r.stdout
