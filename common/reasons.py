"""Abort reasons both ends of a transfer read: the proxy writes them, the decoder's connector acts on them."""

from __future__ import annotations

# The client left: its decode request, if the decoder holds it, is being aborted by vLLM too, so
# the connector waits for that abort instead of recomputing the prompt for nobody.
CLIENT_LEFT = "client disconnected"
