"""`python -m kvstore.server`: the same as `kvstore serve`."""

import sys

from kvstore.server.app import main

sys.exit(main())
