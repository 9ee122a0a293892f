"""Cluster controller: registry, lookup, move, and a web page."""
