"""`kvferry-proxy --workers N`: the supervisor that forks the proxy processes, the load board they
share, and the log that carries admin changes between them."""
