"""`python -m scheduler.cli`: the `mlx-scheduler` command."""

import sys

from scheduler.cli.main import main

sys.exit(main())
