"""`python -m trainer.ranks`: see `trainer.ranks.launch`."""

import sys

from .launch import main

sys.exit(main())
