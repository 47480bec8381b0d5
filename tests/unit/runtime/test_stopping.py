"""Stopping on a signal (stopping.py): a graceful trainer notes it and stops where no step is half done; the
collector, the rollout scatter and the weight push turn it (or a peer lost to it) into `StopRequested`; anything
else exits at once; a watchdog bounds the graceful path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelinerl_fsdp.config import RLConfig
from pipelinerl_fsdp.runtime import stopping
from pipelinerl_fsdp.runtime.stopping import StopRequested
from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.training.collector import Collector
from pipelinerl_fsdp.transport import weights
from pipelinerl_fsdp.transport.rollouts import scatter_samples

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture
def stopped(monkeypatch):
    """This process as if a SIGTERM had come in graceful mode."""
    monkeypatch.setattr(stopping, "_signal", signal.SIGTERM)
    stopping._noted.set()
    yield
    stopping._noted.clear()


def run_script(body: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    code = "import os, signal, sys, time\nfrom pipelinerl_fsdp.runtime import stopping\n" + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_graceful_notes_the_signal_and_the_rank_stops_where_it_checks():
    p = run_script("""
        stopping.install(graceful=True, on_exit=lambda: None)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert stopping.requested() == signal.SIGTERM
        try:
            stopping.raise_if_requested()
        except stopping.StopRequested as e:
            print("raised:", e, flush=True)
            os._exit(128 + e.signum)
        """)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM and "raised: stopped by SIGTERM" in out, out


def test_a_graceful_stop_that_takes_too_long_is_ended_by_the_watchdog():
    # torchrun's shutdown time-out of 6 s leaves 1 s for the checkpoint; the rank never checks
    p = run_script(
        """
        stopping.install(graceful=True, on_exit=lambda: print("children stopped", flush=True))
        os.kill(os.getpid(), signal.SIGINT)
        t0 = time.time()
        while time.time() < t0 + 20:
            time.sleep(0.05)
        print("not stopped", flush=True)
        """,
        {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "6"},
    )
    t0 = time.time()
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGINT and time.time() - t0 < 10, out
    assert "no checkpoint within 1 s" in out and "children stopped" in out and "not stopped" not in out, out


def test_a_second_signal_and_a_non_graceful_rank_exit_at_once():
    for graceful, signals in (("True", "SIGTERM, signal.SIGTERM"), ("False", "SIGTERM")):
        p = run_script(f"""
            stopping.install(graceful={graceful}, on_exit=lambda: print("children stopped", flush=True))
            for s in (signal.{signals},):
                os.kill(os.getpid(), s)
                time.sleep(0.2)
            print("still running", flush=True)
            """)
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 128 + signal.SIGTERM, (graceful, out)
        assert "stopped by signal SIGTERM" in out and "children stopped" in out and "still running" not in out, out


class Source:
    """`error`: the receiver thread failed before the call; `ended`: it failed (or every sender left) while the
    call waited, so the call returns nothing and the source is finished."""

    def __init__(self, error: bool = False, ended: bool = False) -> None:
        self.error, self.ended, self.calls = error, ended, 0

    def get(self, timeout: float):
        self.calls += 1
        if self.error:
            raise RuntimeError("rollout receiver thread failed")
        return None

    def qsize(self) -> int:
        return 0

    def finished(self) -> bool:
        return self.ended


def test_the_collector_stops_instead_of_waiting_for_rollouts(stopped):
    src = Source()
    with pytest.raises(StopRequested):
        Collector(src, RLConfig(attempts=2, batch_size=4), n_engines=1).next_batch(0, 60)
    assert src.calls == 0
    with pytest.raises(StopRequested):  # conventional: even with the round's batches already collected
        c = Collector(src, RLConfig(attempts=2, batch_size=4, mode="conventional"), n_engines=1)
        c._round = [[]]
        c.next_batch(0, 60)
    # the final evaluation is not waited for: the engines are stopping too
    Collector(src, RLConfig(attempts=2, batch_size=4), n_engines=1).wait_for(lambda: False, 0, 60, "the evaluation")


@pytest.mark.parametrize("source", [Source(error=True), Source(ended=True)], ids=["failed", "ended-while-waiting"])
def test_a_peer_lost_to_the_stop_is_a_stop_and_otherwise_an_error(monkeypatch, source):
    c = Collector(source, RLConfig(attempts=2, batch_size=4), n_engines=1)
    monkeypatch.setattr(stopping, "explains_failure", lambda wait_s=5.0: False)
    with pytest.raises(RuntimeError, match="receiver thread failed|stopped sending before training finished"):
        c.next_batch(0, 60)
    with pytest.raises(RuntimeError, match="receiver thread failed|stopped sending before the evaluation"):
        c.wait_for(lambda: False, 0, 60, "the evaluation")

    def signal_arrives(wait_s: float = 5.0) -> bool:  # torchrun's SIGTERM comes just after the peer vanished
        monkeypatch.setattr(stopping, "_signal", signal.SIGTERM)
        return True

    monkeypatch.setattr(stopping, "explains_failure", signal_arrives)
    with pytest.raises(StopRequested):
        c.next_batch(0, 60)


def test_explains_failure_waits_only_as_long_as_asked():
    t0 = time.perf_counter()
    assert not stopping.explains_failure(0.3)
    assert 0.25 < time.perf_counter() - t0 < 2


def _scatter_worker(rank: int, port: int, q) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sample = Sample(7, [1, 2], [3, 4], [-0.5, -0.25], [1, 1], 1.0)
    try:
        parts = [[sample], [sample, sample]] if rank == 0 else None
        got = scatter_samples(parts, None, 0, rank)
        step1 = len(got)
        scatter_samples(None, None, 0, rank, stop=int(signal.SIGINT) if rank == 0 else 0)
        q.put((rank, step1, "no stop"))
    except StopRequested as e:
        q.put((rank, step1, e.signum))
    finally:
        dist.destroy_process_group()


def test_the_first_trainer_rank_stops_every_trainer_rank_at_the_same_step():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_scatter_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == [(0, 1, signal.SIGINT), (1, 2, signal.SIGINT)]


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.sent, self.fail = 0, fail

    def __call__(self, *args, **kwargs):
        self.sent += 1
        if self.fail:
            raise RuntimeError("Connection closed by peer")

        class Done:
            def wait(self) -> None:
                pass

        return Done()


def sender() -> weights.WeightSender:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return weights.WeightSender(model, None, 0, True, torch.float32, torch.device("cpu"), bucket_bytes=64)


def test_the_push_sends_nothing_once_stopping(monkeypatch, stopped):
    rec = Recorder()
    monkeypatch.setattr(weights.dist, "broadcast", rec)
    monkeypatch.setattr(weights, "broadcast_bucket", rec)
    assert sender().push(3) is None and rec.sent == 0


def test_a_push_that_loses_its_engines_fails_unless_the_job_is_stopping(monkeypatch):
    rec = Recorder(fail=True)
    monkeypatch.setattr(weights.dist, "broadcast", rec)
    monkeypatch.setattr(weights, "broadcast_bucket", rec)
    monkeypatch.setattr(stopping, "explains_failure", lambda wait_s=5.0: False)
    with pytest.raises(RuntimeError, match="closed by peer"):
        sender().push(3)
    monkeypatch.setattr(stopping, "explains_failure", lambda wait_s=5.0: True)
    rec.sent = 0
    assert sender().push(3) is None and rec.sent == 1  # the header failed: nothing more was tried
