"""Which replica serves a request: the router's policies, the prefix catalog (which
replica holds which prompt blocks), pinned and published prefixes, and the cache
salts that keep tenants' blocks apart.
"""
