"""Several ranks checkpoint and resume as one attempt.

Fast: the launcher's exit code is the cause among the ranks' exits (not the echoes), a lost
rank's report never hides a bug, the global batch splits over the ranks without a sample
lost or repeated, a bad rendezvous is refused.

Slow (real processes, real gloo, real signals): two ranks under `python -m trainer.ranks`
killed three ways (SIGKILL of rank 1, SIGTERM of rank 0, SIGKILL of the launcher itself)
end bitwise equal to an uninterrupted two-rank run; a rank killed inside a save's barrier never leaves a checkpoint (2 trials,
each kind of kill once, the second from what the first left behind;
`CKPT_TEST_BARRIER_TRIALS=30` runs the 30 of the scale-out proof). That another world size
continues at the global sample position is test_fsdp's (2 -> 1 -> 4, standalone) and
tests/e2e/test_world_dagster.py's (2 -> 1 -> 2, through Dagster).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.polling import wait_for
from tests.rank_runs import (
    env,
    gone,
    one_attempt,
    pointer_step,
    start_direct,
    trainer_argv,
    wait_for_step,
)
from tests.trainer_proc import ROOT, assert_bitwise_equal, write_config
from trainer.api.data import ResumableLoader
from trainer.base.outcomes import Outcome
from trainer.ranks.distributed import rank_file
from trainer.ranks.launch import parse
from trainer.ranks.world import attempt_exit

KILLED = 128 + signal.SIGKILL
PREEMPTED = Outcome.PREEMPTED.exit_code
LOST = Outcome.RANK_LOST.exit_code


# -- fast ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("codes", "expected"), [
    ({1: -signal.SIGKILL, 0: LOST}, KILLED),  # the peer's death, not rank 0's echo of it
    ({0: -signal.SIGKILL, 1: PREEMPTED}, KILLED),
    ({1: Outcome.USER_CODE_ERROR.exit_code, 0: LOST}, Outcome.USER_CODE_ERROR.exit_code),
    ({0: LOST, 1: Outcome.BAD_INPUT.exit_code}, Outcome.BAD_INPUT.exit_code),
    ({0: PREEMPTED, 1: PREEMPTED}, PREEMPTED),
    ({0: -signal.SIGTERM, 1: PREEMPTED}, PREEMPTED),
    ({0: LOST}, LOST),
    ({0: PREEMPTED, 1: LOST}, LOST),
])
def test_the_launcher_exits_with_the_cause_among_the_ranks_not_an_echo(codes, expected):
    assert attempt_exit(codes) == expected


def test_a_lost_ranks_report_never_hides_the_cause_the_exit_status_names():
    lost = Outcome.RANK_LOST.value
    assert Outcome.of_exit(Outcome.RANK_LOST.exit_code, lost) is Outcome.RANK_LOST
    assert Outcome.of_exit(1, lost) is Outcome.USER_CODE_ERROR
    assert Outcome.of_exit(KILLED, lost) is Outcome.KILLED_BY_SIGNAL
    assert Outcome.RANK_LOST.kind.resumable


def test_the_global_batch_splits_over_the_ranks_with_no_sample_lost_or_repeated():
    data = list(range(64))
    whole = ResumableLoader(data, 8, seed=3)
    halves = [ResumableLoader(data, 8, seed=3, rank=r, world=2) for r in range(2)]
    for _ in range(10):  # across an epoch boundary
        expected = next(iter_of(whole)).tolist()
        got = [next(iter_of(h)).tolist() for h in halves]
        assert got[0] + got[1] == expected
    assert {h.state_dict()["position"] for h in halves} == {whole.state_dict()["position"]}


_iters: dict[int, object] = {}


def iter_of(loader: ResumableLoader):
    return _iters.setdefault(id(loader), loader.batches())


def test_a_global_batch_that_does_not_split_evenly_is_refused_naming_the_multiple():
    with pytest.raises(ValueError, match="multiple of 3"):
        ResumableLoader(list(range(64)), 8, rank=0, world=3)


@pytest.mark.parametrize(("flags", "says"), [
    (["--nnodes", "2"], "several nodes need --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--local-nodes", "--rdzv-endpoint", "h:1"],
     "--local-nodes meet on a free loopback port of their own"),
    (["--nproc-per-node", "2000"], "--nproc-per-node 2000 is out of range: pass 1 to 1024"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0 is out of range"),
    (["--nnodes", "1025", "--rdzv-endpoint", "h:1", "--rdzv-id", "r"], "--nnodes 1025"),
    (["--rdzv-endpoint", "node0"], "--rdzv-endpoint: rendezvous endpoint 'node0' is not "
                                   "HOST:PORT"),
    (["--rdzv-endpoint", "node0:99999"], "is not HOST:PORT (a port from 1 to 65535"),
    (["--heartbeat-timeout-s", "0"], "--heartbeat-timeout-s 0 is out of range"),
    (["--nproc-per-node", "abc"], "argument --nproc-per-node: invalid int value: 'abc' (see: "
                                  "python -m trainer.ranks --help)"),
])
def test_a_launch_the_config_would_refuse_exits_2_with_one_line_saying_what_to_pass(
        flags, says, capsys):
    argv = ["--nproc-per-node", "2", *flags, "--", "python", "x.py"]
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == Outcome.BAD_INPUT.exit_code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines


def test_the_launcher_names_itself_by_the_name_it_was_started_by(capsys, monkeypatch):
    """The orchestrator starts it as `ckpt_trainer.ranks` (a project's own trainer.py never
    shadows that name); what it says names the command the user would run again."""
    import types

    from trainer.ranks.launch import started_as

    assert started_as() == "trainer.ranks"
    with pytest.raises(SystemExit):
        parse(["--nproc-per-node", "2", "python", "x.py"])
    err = capsys.readouterr().err
    assert err.startswith("python -m trainer.ranks: put the command after `--`: python -m "
                          "trainer.ranks [...] -- COMMAND"), err
    main = types.SimpleNamespace(__spec__=types.SimpleNamespace(
        name="ckpt_trainer.ranks.__main__", parent="ckpt_trainer.ranks"))
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert started_as() == "ckpt_trainer.ranks"


def test_a_rendezvous_endpoint_on_one_node_is_where_its_ranks_meet():
    from torch.distributed import run as torchrun

    from trainer.ranks.launch import torchrun_args

    args, command = parse(["--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29411",
                           "--", "python", "x.py"])
    parsed = torchrun.parse_args(torchrun_args(args, command))
    assert parsed.rdzv_endpoint == "127.0.0.1:29411" and parsed.rdzv_backend == "c10d"
    assert not parsed.standalone and parsed.nnodes == "1"


def test_the_config_refuses_a_rendezvous_endpoint_that_is_not_host_port():
    from trainer.config import DistributedConfig

    with pytest.raises(ValueError, match="is not HOST:PORT"):
        DistributedConfig(rdzv_endpoint="node0")
    assert DistributedConfig(rdzv_endpoint="node0:29400").rdzv_endpoint == "node0:29400"


@pytest.mark.slow
def test_a_node_killed_after_the_grace_is_an_echo_and_the_node_that_failed_names_the_cause():
    import signal as sig

    from trainer.ranks.nodes import LocalNodes

    bug = subprocess.Popen(["sh", "-c", "exit 1"])
    # Deaf to the stop once its trap is set: told before that, on a busy machine, it would
    # die of the SIGTERM and never need the kill this test is about.
    stuck = subprocess.Popen(["sh", "-c", "trap '' TERM; echo deaf; exec sleep 60"],
                             stdout=subprocess.PIPE)
    assert stuck.stdout.readline() == b"deaf\n"
    nodes = LocalNodes([bug, stuck])
    assert nodes.first_to_end() is bug
    nodes.tell(sig.SIGTERM)
    nodes.wait_out(0.5)
    assert nodes.killed == {1} and stuck.returncode == -sig.SIGKILL
    assert nodes.exit_status() == 1  # the bug, never resumed; not the kill it caused


@pytest.mark.slow
def test_after_a_node_succeeds_the_others_are_waited_for_without_a_deadline():
    from trainer.ranks.nodes import LocalNodes

    done = subprocess.Popen(["true"])
    finishing = subprocess.Popen(["sh", "-c", "sleep 1"])  # still committing its last step
    nodes = LocalNodes([done, finishing])
    assert nodes.first_to_end() is done
    nodes.wait_out(None)
    assert not nodes.killed and nodes.exit_status() == 0


# -- slow: real ranks ------------------------------------------------------------------------

EXPERIMENT, RUN = "default", "equiv"


def _config(tmp_path: Path, name: str, nproc: int) -> Path:
    return write_config(tmp_path / f"{name}.json", max_steps=60, eval_every=20,
                        checkpoint={"every_steps": 4, "keep_last": 2},
                        distributed={"nproc_per_node": nproc})


def _rank_states(store: Path) -> list[dict]:
    ckdir = store / EXPERIMENT / RUN / "checkpoints"
    name = json.loads((ckdir / "latest.json").read_text())["checkpoint"]
    return [torch.load(ckdir / name / rank_file(r), weights_only=True) for r in range(2)]


def _run(config: Path, store: Path, log: Path, kill=None, step_delay: float = 0.05) -> int:
    """One attempt of two ranks; `kill(launcher, ranks)` once the pointer is at its step."""
    return one_attempt(trainer_argv(config, str(store)), 2, log, step_delay, kill)


@pytest.mark.slow
def test_two_ranks_killed_three_ways_end_bitwise_equal_to_an_uninterrupted_two_rank_run(
        tmp_path):
    rng = random.Random(17)
    config = _config(tmp_path, "two", 2)
    ref, store = tmp_path / "ref", tmp_path / "store"
    log = tmp_path / "ranks.log"
    assert _run(config, ref, log, step_delay=0) == 0, log.read_text()[-3000:]

    def at(step: int, what):
        def kill(launcher, ranks):
            wait_for_step(store, EXPERIMENT, RUN, step, launcher)
            what(launcher, ranks)
        return kill

    k1, k2, k3 = sorted(rng.sample(range(4, 56, 4), 3))
    sigkill_rank1 = at(k1, lambda _l, r: os.kill(r[1], signal.SIGKILL))
    assert _run(config, store, log, sigkill_rank1) == KILLED, log.read_text()[-3000:]
    sigterm_rank0 = at(k2, lambda _l, r: os.kill(r[0], signal.SIGTERM))
    assert _run(config, store, log, sigterm_rank0) == PREEMPTED, log.read_text()[-3000:]
    stopped_at = pointer_step(store, EXPERIMENT, RUN)
    assert stopped_at >= k2  # the stop committed the step both ranks agreed on

    ranks_of_killed_launcher: list[int] = []

    def sigkill_launcher(launcher, ranks):
        wait_for_step(store, EXPERIMENT, RUN, max(k3, stopped_at + 4), launcher)
        ranks_of_killed_launcher.extend(ranks.values())
        launcher.send_signal(signal.SIGKILL)

    assert _run(config, store, log, sigkill_launcher) == -signal.SIGKILL
    gone(ranks_of_killed_launcher)  # the orphaned ranks commit and exit with their launcher
    assert _run(config, store, log) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert text.count("resumed from") >= 3
    for r, (got, want) in enumerate(zip(_rank_states(store), _rank_states(ref), strict=True)):
        assert_bitwise_equal(got, want, f"rank {r}")


# Each trial is two fresh ranks (torch, gloo) started and killed: 16 s of a 2-core machine.
# Two prove each of the two kills once, the second from the partial checkpoint the first
# left behind; a soak sets more.
BARRIER_TRIALS = int(os.environ.get("CKPT_TEST_BARRIER_TRIALS", "2"))


def _wait_inside_the_barrier(store: Path, ranks: list, marker: Path, step: int,
                             log: Path) -> None:
    def blocked() -> bool:
        assert all(p.poll() is None for p in ranks), log.read_text()[-3000:]
        return marker.exists()

    wait_for(blocked, 240, what=f"rank 0 inside the save of step {step}")
    pending = store / EXPERIMENT / "barrier" / "checkpoints"
    wait_for(lambda: list(pending.glob(f"step-{step:09d}-*/{rank_file(1)}")), 120,
             what=f"rank 1's file of step {step}")


def _checkpoint_dirs(store: Path, run: str) -> dict[str, bool]:
    """name -> committed (has a manifest), for every checkpoint directory of `run`."""
    ckdir = store / EXPERIMENT / run / "checkpoints"
    return {d.name: (d / "MANIFEST.json").exists() for d in ckdir.glob("step-*")}


def _reap(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.slow
def test_a_rank_killed_inside_a_saves_barrier_never_leaves_a_checkpoint(tmp_path):
    """BARRIER_TRIALS trials, each an attempt that resumes, commits one checkpoint and reaches
    the save of the next, step K: rank 1 has written its file of step K and waits in the barrier
    while rank 0 takes its state; one of the two is SIGKILLed. Step K never becomes a
    checkpoint, the next attempt resumes from the one before it, and retention removes the
    leftovers."""
    store, log = tmp_path / "store", tmp_path / "barrier.log"
    script = [sys.executable, str(ROOT / "tests" / "barrier_user.py"), str(store)]
    max_steps = 2 * BARRIER_TRIALS + 4

    def gated(trial: int) -> list:  # started early; trains once its gate opens
        return start_direct(script, 2, env(0, START_GATE=str(tmp_path / f"gate-{trial}"),
                                           BLOCK_MARKER=str(tmp_path / f"blocked-{trial}"),
                                           MAX_STEPS=str(max_steps)), log)

    ranks, waiting = [], gated(0)
    try:
        for trial in range(BARRIER_TRIALS):
            ranks, waiting = waiting, gated(trial + 1) if trial + 1 < BARRIER_TRIALS else []
            before = pointer_step(store, EXPERIMENT, "barrier")
            block_at = before + 4
            opening = tmp_path / f"gate-{trial}.tmp"  # renamed: never read half written
            opening.write_text(str(block_at))
            opening.replace(tmp_path / f"gate-{trial}")
            _wait_inside_the_barrier(store, ranks, tmp_path / f"blocked-{trial}", block_at, log)
            ranks[trial % 2].send_signal(signal.SIGKILL)
            if trial % 2 == 1:  # rank 1 killed: rank 0 would sleep on inside its part
                ranks[0].send_signal(signal.SIGKILL)
            else:  # rank 0 killed: rank 1 loses its peer in the barrier
                assert ranks[1].wait(timeout=300) == LOST, log.read_text()[-3000:]
            _reap(ranks)
            dirs = _checkpoint_dirs(store, "barrier")
            blocked = [n for n in dirs if n.startswith(f"step-{block_at:09d}-")]
            assert blocked and not any(dirs[n] for n in blocked), dirs
            assert pointer_step(store, EXPERIMENT, "barrier") == before + 2
    finally:
        _reap(ranks + waiting)
    ranks = start_direct(script, 2, env(0, MAX_STEPS=str(max_steps)), log)
    assert [p.wait(timeout=300) for p in ranks] == [0, 0], log.read_text()[-3000:]
    text = log.read_text()
    # Every attempt after the first resumed from the checkpoint before its blocked step.
    for trial in range(1, BARRIER_TRIALS + 1):
        assert f"at step {2 * trial} " in text, trial
    dirs = _checkpoint_dirs(store, "barrier")
    assert all(dirs.values()), f"partial checkpoints left behind: {dirs}"
    assert pointer_step(store, EXPERIMENT, "barrier") == max_steps


def test_a_ranks_collective_error_in_training_code_is_reported_as_a_lost_rank(monkeypatch):
    """DDP's backward raises gloo's RuntimeError when a peer dies: on one of several ranks
    that is a lost rank (resumed), not a bug; alone, a RuntimeError stays a bug."""
    from trainer.process.report import Reporter, report_failure

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:56205. This is typically caused by a remote worker crashing")
    assert report_failure(gloo, Reporter()) == Outcome.USER_CODE_ERROR.exit_code
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert report_failure(gloo, Reporter()) == LOST
    assert report_failure(RuntimeError("shapes do not match"), Reporter()) == \
        Outcome.USER_CODE_ERROR.exit_code
    assert report_failure(RuntimeError("NCCL error: invalid usage"), Reporter()) == \
        Outcome.USER_CODE_ERROR.exit_code  # naming a backend is not losing a peer


def test_a_commands_own_options_reach_it_past_torchruns_parser():
    """torchrun's argparse would read a command's `--run` as an abbreviation of its own
    `--run-path`; the launcher hands the command over after `--`."""
    from torch.distributed import run as torchrun

    from trainer.ranks.launch import torchrun_args

    args, command = parse(["--nproc-per-node", "2", "--", "python", "train.py", "--run", "a"])
    parsed = torchrun.parse_args(torchrun_args(args, command))
    assert [parsed.training_script, *parsed.training_script_args] == command
    assert parsed.max_restarts == 0 and parsed.standalone


@pytest.mark.slow
def test_ranks_that_refuse_their_batch_end_with_one_line_naming_the_outcome_not_torchruns(
        tmp_path):
    config = write_config(tmp_path / "cfg.json", max_steps=4, batch_size=32)
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.ranks", "--nproc-per-node", "3", "--",
         sys.executable, "-m", "trainer", "--config", str(config), "--store",
         str(tmp_path / "store")],
        cwd=ROOT, env=env(0), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300)
    assert proc.returncode == Outcome.BAD_INPUT.exit_code, proc.stdout[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "make it a multiple of 3" in lines[-2], lines[-4:]
    assert lines[-1].startswith("python -m trainer.ranks: the attempt ended bad_input (exit 2)")
    assert "torch/distributed" not in proc.stdout, lines
