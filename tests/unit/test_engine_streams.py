"""The engine's stream seam (docs/backends.md#cuda-streams) on host tensors: a recording
:class:`~hvd_commopt.streams.DeviceStreams` sees each bucket's start inside ``launch`` and its
finish inside ``finish`` in plan order, its buckets once per plan, never per step; the results
are those of the engine without streams, bit for bit; without streams no stream call is made."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, build_engine, run_ranks
from hvd_commopt.buckets import Bucket
from hvd_commopt.engine import TensorSpec
from hvd_commopt.streams import NO_STREAMS, BucketStream, DeviceStreams, NoStreams

SPECS = [TensorSpec("l1.w", (8, 6), "float32"), TensorSpec("l1.b", (8,), "float32"),
         TensorSpec("l2.w", (4, 8), "float32"), TensorSpec("l2.b", (4,), "float32")]


class RecordingBucketStream:
    def __init__(self, log: list, index: int):
        self.log, self.index = log, index

    @contextmanager
    def launch(self, tensors: Sequence[Any]) -> Iterator[None]:
        self.log.append(("launch", self.index, len(tensors)))
        yield
        self.log.append(("launched", self.index))

    @contextmanager
    def finish(self) -> Iterator[None]:
        self.log.append(("finish", self.index))
        yield
        self.log.append(("finished", self.index))

    def hand_over(self, tensors: Sequence[Any]) -> None:
        self.log.append(("hand_over", self.index, len(tensors)))


class RecordingStreams:
    def __init__(self):
        self.log: list = []
        self.made: list[int] = []

    def for_bucket(self, bucket: Bucket) -> BucketStream | None:
        self.made.append(bucket.index)
        return RecordingBucketStream(self.log, bucket.index)


def _grads(rank: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}


def _train(compression, streams, steps=3, log_calls=False):
    def body(comm):
        eng = build_engine(comm, NumpyOps(), compression=compression() if compression else None,
                           fusion_threshold=64, streams=streams() if streams else None)
        eng.register(SPECS)
        calls: list = []
        if log_calls:  # the reducer's start/finish, in the same log as the seam's calls
            log = eng.engine.streams.log
            r = eng.reducer
            start, finish = r.start, r.finish
            r.start = lambda b, *a: (log.append(("start", b.index)), start(b, *a))[1]
            r.finish = lambda p, ctx: (log.append(("reducer.finish",)), finish(p, ctx))[1]
        out = []
        for s in range(steps):
            g = _grads(comm.rank, s)
            for name in eng.backward_names:
                eng.grad_ready(name, g[name])
            out.append({k: np.array(v, copy=True) for k, v in eng.reduce_step().items()})
        st = eng.engine.streams
        if isinstance(st, RecordingStreams):
            calls = [list(st.made), list(st.log)]
        return out, calls, len(eng.buckets)
    return run_ranks(2, body)


COMPRESSIONS = {"none": None, "fp16": lambda: Compression.fp16, "topk": lambda: Compression.topk(0.25)}


def test_protocols_and_the_host_implementation():
    assert isinstance(RecordingStreams(), DeviceStreams)
    assert isinstance(NO_STREAMS, DeviceStreams) and isinstance(NO_STREAMS, NoStreams)
    assert isinstance(RecordingBucketStream([], 0), BucketStream)
    assert NO_STREAMS.for_bucket(Bucket(0, "bucket0:a", ("a",), ((2,),), (0,), 2, "float32")) is None


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_results_with_streams_are_those_without_bit_for_bit(name):
    plain = _train(COMPRESSIONS[name], None)
    host = _train(COMPRESSIONS[name], lambda: NO_STREAMS)
    rec = _train(COMPRESSIONS[name], RecordingStreams)
    for other in (host, rec):
        for (a, _, _), (b, _, _) in zip(plain, other):
            for step_a, step_b in zip(a, b):
                assert step_a.keys() == step_b.keys()
                for k in step_a:
                    assert step_a[k].tobytes() == step_b[k].tobytes(), (name, k)


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_each_bucket_starts_inside_launch_and_finishes_inside_finish_in_plan_order(name):
    steps = 3
    for _, (made, log), n in _train(COMPRESSIONS[name], RecordingStreams, steps=steps, log_calls=True):
        assert n >= 2
        assert made == list(range(n))  # once per bucket and plan, not per step
        per_step = 3 * n + 4 * n  # launch, start, launched; finish, reducer.finish, finished, hand_over
        assert len(log) == steps * per_step
        for s in range(steps):
            chunk = log[s * per_step:(s + 1) * per_step]
            launches, finishes = chunk[:3 * n], chunk[3 * n:]
            for i in range(n):  # every bucket is launched before the step finishes any
                (tag, idx, reads), start, launched = launches[3 * i:3 * i + 3]
                assert (tag, idx) == ("launch", i) and reads >= 1
                assert start == ("start", i) and launched == ("launched", i)
            for i in range(n):
                f, rf, done, hand = finishes[4 * i:4 * i + 4]
                assert f == ("finish", i) and rf == ("reducer.finish",) and done == ("finished", i)
                assert hand[:2] == ("hand_over", i) and hand[2] >= 1


def test_without_streams_the_engine_makes_no_stream_call():
    def body(comm):
        eng = build_engine(comm, NumpyOps(), fusion_threshold=64)
        eng.register(SPECS)
        assert eng.engine.streams is None and eng.engine._bucket_streams is None
        g = _grads(comm.rank, 0)
        for name in eng.backward_names:
            eng.grad_ready(name, g[name])
        eng.reduce_step()
        return eng.engine._bucket_streams
    assert run_ranks(2, body) == [None, None]


def test_a_replan_gives_each_new_bucket_its_stream_once():
    def body(comm):
        st = RecordingStreams()
        eng = build_engine(comm, NumpyOps(), fusion_threshold=64, streams=st)
        eng.register(SPECS)
        first = list(st.made)
        eng.set_plan([[0, 1, 2, 3]])
        return first, st.made[len(first):]
    for first, second in run_ranks(2, body):
        assert len(first) >= 2 and second == [0]


def test_on_the_device_route_the_step_reads_every_buckets_flags_once(monkeypatch):
    """The device route (forced on host arrays): each bucket's NaN/Inf flags are handed over with
    its result, every bucket's are read in one ``read_flags`` per step after all finishes, and
    each bucket is then settled inside its own stream's ``finish`` (docs/selection.md#one-read-per-step);
    the results are the host route's, bit for bit, a NaN step skipped on every bucket."""
    from hvd_commopt.select import kernels as K

    reads: list[int] = []
    orig = NumpyOps.read_flags
    monkeypatch.setattr(NumpyOps, "read_flags", lambda self, flags: (reads.append(len(flags)), orig(self, flags))[1])

    def grads(rank, step):
        g = _grads(rank, step)
        if step == 1 and rank == 0:
            g["l2.w"][1, 2] = np.nan
        return g

    def run(device: bool):
        monkeypatch.setattr(K, "HOST_KERNELS", not device)

        def body(comm):
            eng = build_engine(comm, NumpyOps(), compression=Compression.topk(0.25, dense_1d=True),
                               fusion_threshold=64, streams=RecordingStreams())
            eng.register(SPECS)
            out = []
            for s in range(3):
                g = grads(comm.rank, s)
                for name in eng.backward_names:
                    eng.grad_ready(name, g[name])
                out.append({k: np.array(v, copy=True) for k, v in eng.reduce_step().items()})
            return out, list(eng.engine.streams.log), len(eng.buckets)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return run_ranks(2, body)

    host = run(False)
    reads.clear()
    dev = run(True)
    n = dev[0][2]
    assert n >= 3 and reads == [2 * n] * 6  # 2 ranks x 3 steps, every bucket's two flags at once
    for (a, _, _), (b, log, _) in zip(host, dev):
        for step_a, step_b in zip(a, b):
            assert all(step_a[k].tobytes() == step_b[k].tobytes() for k in step_a)
        per_step = len(log) // 3
        chunk = log[:per_step]
        settles = chunk[-2 * n:]  # after every bucket's finish and hand-over: a finish per bucket
        assert settles == [e for i in range(n) for e in (("finish", i), ("finished", i))], chunk
        hands = [e for e in chunk if e[0] == "hand_over"]
        assert len(hands) == n and all(h[2] >= 3 for h in hands)  # the result and the two flags
