"""The ``lm://`` remote store, whole: its wire protocol, the client the remote tier uses, and the
server ``kvferry-server`` runs (LMCache's ``lmcache_server``; docs/lm_server.md)."""
