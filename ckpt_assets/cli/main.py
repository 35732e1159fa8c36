"""`python -m ckpt_assets` / `ckpt-assets`: register, launch and inspect training runs.

    register NAME --config FILE [--experiment E]   record the run's config, add the partition
    launch   NAME [--config FILE] [--experiment E] register if needed, queue a train_job run
                                                   (none if one is active: exit 0, says which)
    list     [--json] [--state S] [--experiment E] [--since WHEN] [--limit N] [--all]
                                                   runs: state, attempts, latest step and
                                                   checkpoint; by default every open run and
                                                   the 50 that ended last (standalone runs
                                                   too, found in the store)
    lineage  NAME [--json] [--experiment E]        attempts, checkpoints (parent links), model
    run      NAME [--config FILE] [--experiment E] register if needed, train it in this
                                                   process (no daemon); exit with the
                                                   attempt's code (143: preempted; run it
                                                   again to resume)
    stop     NAME                                  terminate its active run; do not resume it

Common options: --store URI (default $CKPT_STORE_URI, else ./checkpoints under the repo;
the same default as the code location's CheckpointStore): `run` registers, trains and
reports in it; `launch` takes only the store the daemon's code location trains in (set
CKPT_STORE_URI for both), and refuses another. The Dagster instance is $DAGSTER_HOME
(default: dagster_home/ under the repository root).

A command run's config is checked at registration, before the name is taken: its `cwd`
must be a directory, `python` is this interpreter and its script must exist in `cwd`, a
program path must be an executable file, a bare program must be on PATH. Relative paths
(`cwd`, and the script or program relative to `cwd`) are relative to the directory the
CLI runs in (not this checkout), and are recorded absolute; no `cwd` means that directory.
Absolute paths are taken as they are. A run with no committed checkpoint (and no active Dagster run)
may be registered again with a corrected config: there is nothing it could contradict, and
`register` says it replaced the config; once a checkpoint is committed the config is fixed.

Exit codes (the trainer's): 0 ok; 2 bad input (name, config, arguments, an unusable
local store path; nothing was written); 5 store unavailable (S3 endpoint, bucket or
credentials; nothing was written); 1 anything else (e.g. the launch failed). `run` exits
with its attempt's code: also 143 preempted (run it again to resume), 3 no checkpoint
could be loaded, 4 diverged, 6 superseded, 7 a rank lost, 8 no step trained (the table:
docs/reference.md). `launch` of a run that already has a queued or running Dagster run
queues nothing, names that run and exits 0; of several concurrent launches of one name
exactly one queues a run, and the others name it and exit 0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ckpt_assets.base.names import REPO_ROOT
from ckpt_assets.cli.parser import parser
from ckpt_assets.cli.store import launched_runs_store, store_of, train_here_in
from trainer.base import strict_json
from trainer.base.outcomes import Outcome

# The CLI answers with the trainer's codes: 2 bad input, 5 store unavailable, 1 otherwise.
EXIT_OK = Outcome.SUCCESS.exit_code
EXIT_ERROR = Outcome.USER_CODE_ERROR.exit_code
EXIT_BAD_INPUT = Outcome.BAD_INPUT.exit_code


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.code = code


def _instance():
    if not os.environ.get("DAGSTER_HOME"):
        home = REPO_ROOT / "dagster_home"
        os.environ["DAGSTER_HOME"] = str(home)
        print(f"note: DAGSTER_HOME is not set; using {home}", file=sys.stderr)
    import dagster as dg

    try:
        return dg.DagsterInstance.get()
    except Exception as e:
        raise CliError(f"cannot open the Dagster instance at DAGSTER_HOME="
                       f"{os.environ['DAGSTER_HOME']}: {e}", EXIT_ERROR) from e


def _read_config(path: str) -> dict:
    from trainer.base.errors import ConfigError
    from trainer.config_file import read_config_file

    try:
        raw = read_config_file(path)
    except ConfigError as e:
        raise CliError(str(e)) from None
    if not isinstance(raw, dict):
        raise CliError(f"config file {path} must hold a mapping, not {type(raw).__name__}")
    return raw


def _registered_from() -> Path:
    """What a command's relative paths are relative to: the directory the user registers
    from, as for any program they start from a shell (the examples' configs name their
    scripts from the repository root, where the README runs them)."""
    return Path.cwd()


def cmd_register(args) -> int:
    from ckpt_assets.base.registration import (
        normalize_training_config,
        register_training_run,
        validate_partition_key,
    )

    validate_partition_key(args.name)
    raw = _read_config(args.config)
    base = _registered_from()
    store = store_of(args.store)
    # Validate before touching the instance, so that bad input creates nothing anywhere.
    normalize_training_config(raw, args.name, args.experiment, base)
    instance = _instance()
    reg = register_training_run(store, args.name, raw, args.experiment, instance=instance,
                                base_dir=base, may_correct=True)
    _print_registered(reg)
    return EXIT_OK


def _print_registered(reg) -> None:
    if reg.corrected:
        print(f"re-registered: training run {reg.run} had no committed checkpoint, so its "
              f"config was replaced ({reg.corrected}); config {reg.config_uri}")
        return
    what = "registered" if reg.created else "already registered (same config)"
    print(f"{what}: training run {reg.run} in experiment {reg.experiment}; config {reg.config_uri}")


def _asked_world(args) -> dict[str, str]:
    """The world size `--nproc-per-node`/`--nnodes` ask for, by `distributed` key."""
    from ckpt_assets.base.tags import WORLD_TAGS

    return {key: str(v) for key in WORLD_TAGS if (v := getattr(args, key, None)) is not None}


def _world_tags(args, reg, chain: dict[str, str]) -> dict[str, str]:
    """The tags that ask for the attempt's world size: what the chain carries, with what
    the flags change, once the run's config at that size is valid (a batch that does not
    split over the ranks is refused here, before anything is queued)."""
    from ckpt_assets.base.tags import world_of, world_tags
    from ckpt_assets.runs.world import at_world

    world = {**world_of(chain), **_asked_world(args)}
    at_world(reg, world)
    return world_tags(world)


def _launch_tags(args) -> dict[str, str]:
    from ckpt_assets.base.tags import PARTITION_TAG, WORLD_TAGS

    tags = {}
    for t in args.tag:
        k, sep, v = t.partition("=")
        if not sep or not k:
            raise CliError(f"--tag {t!r}: expected KEY=VALUE")
        if k == PARTITION_TAG:
            raise CliError(f"--tag {t!r}: the partition is the training run's name; "
                           "drop this tag")
        if flag := next((key for key, tag in WORLD_TAGS.items() if tag == k), None):
            raise CliError(f"--tag {t!r}: pass --{flag.replace('_', '-')} instead, which "
                           "checks the config at that world size")
        tags[k] = v
    return tags


def cmd_launch(args) -> int:
    """Register if needed, then queue a train_job run (`ckpt_assets.runs.submit`): once, even
    when launches of the name race. A run that is active already is what the user asked
    for: that is reported, and the launch succeeds without queuing another; so is a run
    that finished (`--force` queues one all the same)."""
    from ckpt_assets.lifecycle.rerun import already_finished, rerun_tags
    from ckpt_assets.runs.submit import SubmitError, launch_training_run

    tags = _launch_tags(args)
    instance, store = _validated(args)
    launched_runs_store(args.name, args.store, store)
    reg = _registered(args, instance, store)
    if not args.force and (done := already_finished(instance, reg)):
        print(done)
        return EXIT_OK
    chain = rerun_tags(instance, args.name)
    tags.update(_world_tags(args, reg, chain))
    try:
        launch = launch_training_run(instance, args.name, {**chain, **tags},
                                     force=args.force)
    except SubmitError as e:
        raise CliError(str(e), EXIT_ERROR) from e
    _print_launch(reg, launch, instance)
    return EXIT_OK


def _print_launch(reg, launch, instance) -> None:
    from dagster import DagsterRunStatus

    from ckpt_assets.base.queries import ACTIVE_STATUSES
    from ckpt_assets.lifecycle.state import queue_running

    run_id, status = launch.run.run_id, launch.run.status
    if launch.created:
        print(f"launched train_job for training run {reg.run} (experiment {reg.experiment}): "
              f"Dagster run {run_id} {status.value}")
        if status == DagsterRunStatus.QUEUED and queue_running(instance):
            print("a dagster-daemon runs the queue: the run starts as soon as it is dequeued "
                  "(`ckpt-assets list` shows it)")
        elif status == DagsterRunStatus.QUEUED:
            print("no dagster-daemon runs the queue here: the run waits until one does "
                  "(start `dagster-daemon run` or `dagster dev` with this DAGSTER_HOME)")
    elif status in ACTIVE_STATUSES:
        print(f"training run {reg.run} already has an active Dagster run: {run_id} "
              f"({status.value}); nothing else queued (it resumes by itself; --force queues "
              "another)")
    else:  # a concurrent launch created it, and it has ended since
        print(f"training run {reg.run}: Dagster run {run_id} ({status.value}) was launched by "
              "another launch at the same moment; nothing else queued")


def _validated(args):
    """(instance, store) once the name and the config (if given) are valid: bad input
    creates nothing anywhere, not even the instance."""
    from ckpt_assets.base.registration import normalize_training_config, validate_partition_key
    from ckpt_assets.runs.world import world_config

    validate_partition_key(args.name)
    store = store_of(args.store)
    if args.config is not None:
        world_config(normalize_training_config(_read_config(args.config), args.name,
                                               args.experiment, _registered_from()),
                     _asked_world(args))
    return _instance(), store


def _registered(args, instance, store):
    """`launch` and `run`: register the config if one is given, else read the registration."""
    from ckpt_assets.base.registration import (
        add_partition,
        read_registration,
        register_training_run,
    )

    if args.config is not None:
        reg = register_training_run(store, args.name, _read_config(args.config),
                                    args.experiment, instance=instance,
                                    base_dir=_registered_from(), may_correct=True)
        if reg.corrected:
            _print_registered(reg)
        return reg
    reg = read_registration(store, args.name)
    if reg is None:
        raise CliError(f"training run {args.name!r} is not registered in {store.uri}; "
                       "pass --config FILE the first time")
    add_partition(instance, args.name)
    return reg


def cmd_run(args) -> int:
    """Train the run here, through the assets, and exit with its attempt's code
    (`ckpt_assets.cli.run_here`): the daemon-less path for CI."""
    from ckpt_assets.base.tags import TAG_ATTEMPT
    from ckpt_assets.cli.run_here import run_in_process, summary
    from ckpt_assets.lifecycle.rerun import already_finished, rerun_tags
    from ckpt_assets.lifecycle.state import sensors_running

    instance, store = _validated(args)
    train_here_in(store)
    reg = _registered(args, instance, store)
    if done := already_finished(instance, reg):
        print(done)
        return EXIT_OK
    tags = rerun_tags(instance, args.name)
    what = f"attempt {tags[TAG_ATTEMPT]}" if tags else "training"
    tags.update(_world_tags(args, reg, tags))
    log = None if args.verbose else Path(instance.root_directory) / "logs" / f"run-{reg.run}.log"
    print(f"{what} of training run {reg.run} (experiment {reg.experiment}) in this process"
          + (f"; Dagster's log: {log} (--verbose shows it here)" if log else ""), flush=True)
    attempted = run_in_process(instance, args.name, tags, log)
    print(summary(instance, args.name, attempted, sensors_running(instance)), flush=True)
    return attempted.code


def cmd_list(args) -> int:
    from ckpt_assets.cli.list_runs import filters_of, not_shown, print_rows, select

    want = filters_of(args)
    rows, hidden = select(_instance(), store_of(args.store), want)
    if args.json:
        print(strict_json.dumps(rows, indent=1))
        if hidden:  # the rows stay one JSON document on stdout
            print(not_shown(hidden, want), file=sys.stderr)
        return EXIT_OK
    print_rows(rows, hidden, want)
    return EXIT_OK


def cmd_lineage(args) -> int:
    from ckpt_assets.base.registration import validate_partition_key
    from ckpt_assets.records.lineage import format_lineage, lineage_report, standalone_report
    from ckpt_assets.records.listing import DEFAULT_EXPERIMENT

    validate_partition_key(args.name)
    store = store_of(args.store)
    instance = _instance()
    experiment = args.experiment or DEFAULT_EXPERIMENT
    try:
        rep = lineage_report(instance, store, args.name)
    except KeyError:
        try:
            rep = standalone_report(store, experiment, args.name)
        except KeyError:
            raise CliError(f"training run {args.name!r} is not registered in {store.uri}, "
                           f"and experiment {experiment!r} has no standalone run of that "
                           "name (a script's run: pass --experiment)") from None
    print(strict_json.dumps(rep, indent=1) if args.json else format_lineage(rep))
    return EXIT_OK


def cmd_stop(args) -> int:
    """Stop the training run for good (`ckpt_assets.lifecycle.stop`): its active runs are tagged not to
    be resumed, then canceled or terminated (the trainer commits a checkpoint and exits)."""
    from ckpt_assets.lifecycle.stop import NOT_REACHED, stop_training_run

    actions = stop_training_run(_instance(), args.name, args.reason, force=args.force)
    if not actions:
        raise CliError(f"training run {args.name!r} has no queued or running Dagster run")
    for action in actions:
        print(action)
    if any(a.action == NOT_REACHED for a in actions):
        raise CliError("a run worker could not be reached; retry with --force, or terminate "
                       "it from the Dagster UI", EXIT_ERROR)
    return EXIT_OK


COMMANDS = {"register": cmd_register, "launch": cmd_launch, "run": cmd_run, "list": cmd_list,
            "lineage": cmd_lineage, "stop": cmd_stop}


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    from trainer.base.errors import ConfigError, StorageError, TrainerError

    try:
        return COMMANDS[args.command](args)
    except CliError as e:
        print(f"ckpt-assets: error: {e}", file=sys.stderr)
        return e.code
    except (ConfigError, StorageError, TrainerError) as e:
        # The trainer's own classification: ConfigError -> 2, StorageError -> 5.
        print(f"ckpt-assets: error: {e}", file=sys.stderr)
        passed_on = (Outcome.BAD_INPUT, Outcome.STORAGE_UNAVAILABLE)
        return e.exit_code if e.outcome in passed_on else EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
