"""HTTP: the one outgoing client, the servers' connection bounds, and the Host/Origin guard."""
