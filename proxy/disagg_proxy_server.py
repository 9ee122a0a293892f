"""`python proxy/disagg_proxy_server.py ...`: kvferry's drop-in for LMCache's disagg_proxy_server.py.

Same flags (--host --port --prefiller-host --prefiller-port --num-prefillers --decoder-host
--decoder-port --decoder-init-port --decoder-alloc-port --num-decoders --proxy-host --proxy-port),
plus --prefiller URL / --decoder URL,init,alloc and --config FILE. `kvferry-proxy` and
`python -m kvferry.proxy` run the same server.
"""

import os
import sys

if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0]; its module names must not shadow anything.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from kvferry.proxy.server import main

    sys.exit(main())
