import sys

from ckpt_assets.cli.main import main

sys.exit(main())
