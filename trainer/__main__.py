from .cli import main
from .process.exit_hooks import exit_now

# Once `main` returns, the attempt has committed, reported and closed everything it opened:
# what is left is the interpreter's teardown of torch, 0.8 s idle and seconds on a busy
# machine, which the run would wait for. (`trainer.cli.main` called in a process of the
# caller's own returns as usual.)
exit_now(main())
