"""`ckpt-assets`' command line: its commands, their arguments and their help."""

from __future__ import annotations

import argparse

from trainer.base.outcomes import Outcome

EXIT_BAD_INPUT = Outcome.BAD_INPUT.exit_code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, as for every other bad input: what was wrong, and where the rest is.
        self.exit(EXIT_BAD_INPUT, f"ckpt-assets: error: {message} (see: {self.prog} "
                                  "--help)\n")


def parser(description: str) -> argparse.ArgumentParser:
    p = _Parser(prog="python -m ckpt_assets", description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default=None, help="checkpoint store URI")
    common = argparse.ArgumentParser(add_help=False)  # --store after the command works too
    common.add_argument("--store", default=argparse.SUPPRESS, help="checkpoint store URI")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # Another world size than the registered config's, for this launch and its resumes.
    world = argparse.ArgumentParser(add_help=False)
    world.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="ranks per node for this launch and its resumes (default: the "
                            "registered config's distributed.nproc_per_node)")
    world.add_argument("--nnodes", type=int, default=None, metavar="M",
                       help="nodes for this launch and its resumes (default: the "
                            "registered config's distributed.nnodes)")

    r = sub.add_parser("register", parents=[common], help="record a run's training config and add its partition")
    r.add_argument("name", help="training run name = partition key")
    r.add_argument("--config", required=True, help="training config file (JSON or YAML)")
    r.add_argument("--experiment", default=None)

    la = sub.add_parser("launch", parents=[common, world], help="register if needed, then queue a train_job run")
    la.add_argument("name")
    la.add_argument("--config", default=None, help="training config (needed the first time)")
    la.add_argument("--experiment", default=None)
    la.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                    help="extra run tag (repeatable)")
    la.add_argument("--force", action="store_true",
                    help="queue another run even if the run already has a queued or running "
                         "Dagster run, or has finished")

    ru = sub.add_parser("run", parents=[common, world],
                        help="register if needed, then train the run in this process (no "
                             "daemon); exit with the attempt's exit code")
    ru.add_argument("name")
    ru.add_argument("--config", default=None, help="training config (needed the first time)")
    ru.add_argument("--experiment", default=None)
    ru.add_argument("--verbose", action="store_true",
                    help="show Dagster's own log here instead of writing it to a file")

    st = sub.add_parser("stop",
                        help="terminate the run's active Dagster run and mark it not to be resumed")
    st.add_argument("name")
    st.add_argument("--reason", default=None, help="why (recorded on the run)")
    st.add_argument("--force", action="store_true",
                    help="also mark runs canceled whose run worker cannot be reached")

    _list(sub, common)

    lg = sub.add_parser("lineage", parents=[common], help="attempts, checkpoints and final model of one run")
    lg.add_argument("name")
    lg.add_argument("--json", action="store_true")
    lg.add_argument("--experiment", default=None,
                    help="a standalone run's experiment (default: 'default')")
    return p


def _list(sub, common: argparse.ArgumentParser) -> None:
    li = sub.add_parser(
        "list", parents=[common],
        help="training runs with state, attempts and latest checkpoint",
        description="By default: every open run, whatever its age (queued, training, "
                    "stopping, terminating, deciding, waiting for back-off, resuming, not "
                    "launched), then the 50 that ended last (finished, stopped by policy, "
                    "stopped by user), newest first, then standalone runs found in the store; "
                    "a last line counts the runs not shown.")
    li.add_argument("--json", action="store_true", help="the rows as JSON (the count of "
                    "runs not shown goes to stderr)")
    li.add_argument("--state", action="append", default=[], metavar="STATE",
                    help="only runs in this state (repeatable): not-launched, queued, "
                         "training, stopping, terminating, deciding, waiting-for-back-off, "
                         "resuming, finished, stopped-by-policy, stopped-by-user, standalone; "
                         "the start of a state names all it starts (waiting, stopped)")
    li.add_argument("--experiment", action="append", default=[], metavar="E",
                    help="only runs of this experiment (repeatable), registered or "
                         "standalone (default: registered runs of every experiment, "
                         "standalone runs of 'default' and of the experiments shown)")
    li.add_argument("--since", default=None, metavar="WHEN",
                    help="only ended runs changed since WHEN: a duration back from now "
                         "(90m, 12h, 7d, 2w) or a UTC date or time (2026-12-01, "
                         "2026-12-01T08:00); open runs are shown whatever their age")
    li.add_argument("--limit", type=int, default=None, metavar="N",
                    help="at most N ended runs, and N standalone runs (default 50; 0: open "
                         "runs only)")
    li.add_argument("--all", action="store_true",
                    help="every run, no limit (reads each run: seconds on an instance of "
                         "thousands)")
