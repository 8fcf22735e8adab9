"""Sources deliver Scrapes: live HTTP scrapes, recordings, single exposition files.

A source knows nothing about engines; it hands exposition bodies, as served, to the adapters.
"""
