import sys

from ckpt_assets.cli import main

sys.exit(main())
