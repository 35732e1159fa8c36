"""Run a command as a child subreaper and record how every process of its tree exited.

    python tests/subreaper.py STATUS_FILE -- CMD...

A process whose parent dies is handed to the nearest subreaper instead of init, so the
exit status of a trainer whose launching process was killed, which nobody else can see,
is seen here. STATUS_FILE gets one JSON line for the command ({"command": pid}) and one per
process reaped ({"pid": ..., "exit": ...}; a negative exit: killed by that signal). This
exits once no process of the tree is left. Linux only (PR_SET_CHILD_SUBREAPER).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    status_file, argv = sys.argv[1], sys.argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise SystemExit(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    pid = os.fork()
    if pid == 0:
        os.execvp(argv[0], argv)
    with open(status_file, "a") as out:
        out.write(json.dumps({"command": pid}) + "\n")
        out.flush()
        while True:
            try:
                reaped, status = os.wait()
            except ChildProcessError:
                return 0
            out.write(json.dumps({"pid": reaped, "exit": os.waitstatus_to_exitcode(status)})
                      + "\n")
            out.flush()


def read_status(path) -> tuple[int | None, dict[int, int]]:
    """(the command's pid, {pid: exit} of every process reaped so far)."""
    command, exits = None, {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None, {}
    for line in lines:
        rec = json.loads(line)
        if "command" in rec:
            command = rec["command"]
        else:
            exits[rec["pid"]] = rec["exit"]
    return command, exits


if __name__ == "__main__":
    sys.exit(main())
