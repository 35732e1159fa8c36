"""`python -m trainer --config FILE [--store URI] [--resume auto|never|URI]`.

Exit codes: 0 done; 143 stopped by SIGTERM/SIGINT after a checkpoint was committed;
2 bad config or input; 3 checkpoint could not be loaded; 4 diverged; 5 store unavailable
after retries; 6 superseded by a newer attempt of the same run; 1 any other error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .base.outcomes import Outcome

log = logging.getLogger("trainer")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits 2 too; keep its one-line message
        self.print_usage(sys.stderr)
        self.exit(Outcome.BAD_INPUT.exit_code, f"trainer: error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m trainer", description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="training config (JSON or YAML)")
    p.add_argument("--store", default=None,
                   help="checkpoint store: file:///abs/path, a path, or s3://bucket/prefix "
                        "(default: $CKPT_STORE_URI, else ./checkpoints)")
    p.add_argument("--resume", default=None,
                   help="auto (default: newest valid checkpoint, else fresh), never, or the "
                        "URI of one checkpoint (default: $CKPT_RESUME_FROM)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # Imported here so that `--help` and argument errors answer without loading torch.
    from .config_file import load_config
    from .process.report import Reporter, report_failure

    reporter = Reporter.shared()
    try:
        config = load_config(args.config)
        # torch (3 s of CPU with Dynamo) only once the config is known good: a bad one is
        # refused in a fraction of a second.
        from .loop import train

        code = train(config, args.store, args.resume)
    except Exception as e:  # before training began: the config
        code = report_failure(e, reporter)
    reporter.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
