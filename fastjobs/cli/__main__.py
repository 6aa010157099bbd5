"""`python -m fastjobs.cli`."""

import sys

from .command import main

sys.exit(main())
