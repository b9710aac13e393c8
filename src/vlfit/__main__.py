"""``python -m vlfit <command>`` (what torchrun and accelerate launch run)."""

import sys

from vlfit.cli import main

sys.exit(main())
