"""`python -m kvstore.server`: the same as `kvstore serve`."""

import sys

from kvstore.server.main import main

sys.exit(main())
