"""``python -m moe_fp8 COMMAND`` is the same as the ``moe-fp8 COMMAND`` console script."""

import sys

from moe_fp8.cli import main

sys.exit(main())
