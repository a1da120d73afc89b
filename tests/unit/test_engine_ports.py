"""The engine's seams are declared and kept: every scheduler implements the ports the engine and
the Trainer call (RoundSource, StepScheduler, Checkpointable), the engine implements the ports
the schedulers and the checkpoint/settings code read (RoundPort, StatePort, SettingsPort), and no
engine module reads another object's private fields."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hvd_commopt import Compression, NumpyOps, Schedule, build_engine, run_ranks
from hvd_commopt.engine import Checkpointable, CommEngine, RoundSource, StepScheduler, Trainer
from hvd_commopt.engine.settings import SettingsPort
from hvd_commopt.engine.state import StatePort
from hvd_commopt.host import GradientCapture, ScheduleHost
from hvd_commopt.schedule import RoundPort, Scheduler

ENGINE_DIR = Path(__file__).resolve().parents[2] / "hvd_commopt" / "engine"


@pytest.mark.parametrize("schedule", [Schedule.sync(), Schedule.od(), Schedule.ssd(), Schedule.cd(),
                                      Schedule.cocod(2), Schedule.local_sgd(2)], ids=lambda s: s.kind)
def test_every_scheduler_implements_the_engine_side_ports(schedule):
    def body(comm):
        trainer = build_engine(comm, NumpyOps(), schedule=schedule)
        return trainer, trainer.scheduler, trainer.engine
    trainer, sched, engine = run_ranks(1, body)[0]
    assert isinstance(trainer, Trainer) and isinstance(sched, Scheduler)
    for port in (RoundSource, StepScheduler, Checkpointable):
        assert isinstance(sched, port), port.__name__
    for port in (RoundPort, StatePort, SettingsPort):
        assert isinstance(engine, CommEngine) and isinstance(engine, port), port.__name__


def test_sparse_reducer_and_capture_host_conform():
    trainer = run_ranks(1, lambda comm: build_engine(comm, NumpyOps(), compression=Compression.topk(0.1)))[0]
    assert isinstance(trainer.engine, SettingsPort)
    assert isinstance(GradientCapture(), ScheduleHost)


def test_no_engine_module_reads_another_objects_private_fields():
    reads = []
    for path in sorted(ENGINE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reads.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert reads == []
