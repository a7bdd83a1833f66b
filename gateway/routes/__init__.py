"""The HTTP routes, a module per API (after vLLM's entrypoints): `openai` (inference,
/tokenize), `admin` (tenants, keys, usage, backends, stats), `prefixes` (pins and the
prefix-cache report), `openapi` (the document, from its route table `openapi_routes` and
its request bodies `openapi_requests`); `guards` holds the key checks they share.
Handlers only parse, call the services below and format.
"""
