"""`python -m kvstore.cli`: the `kvstore` command where its console script is not on PATH."""

import sys

from kvstore.cli import main

sys.exit(main())
