"""`python -m kvferry.proxy ...`: the disaggregation proxy (see disagg_proxy_server.py)."""

import sys

from kvferry.proxy.server import main

sys.exit(main())
