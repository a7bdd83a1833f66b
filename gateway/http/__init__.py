"""The HTTP transport and what every handler shares: the hardened server, bounded body
parsing and JSON responses, OpenAI-shaped errors, and the middleware that turns every
failure into one. Nothing here knows a route.
"""
