"""`python -m megatron_stepwise.cli`."""

import sys

from megatron_stepwise.cli.main import main

sys.exit(main())
