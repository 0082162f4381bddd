"""``python -m sharktank.cli``: what torchrun launches on each host."""

import sys

from . import main

sys.exit(main())
