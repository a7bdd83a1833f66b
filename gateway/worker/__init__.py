"""`kvgate worker`: one engine adapter in its own process, served over HTTP.

A gateway reaches it through the `remote` backend adapter (gateway/backends/remote.py),
so engines can run beside the gateway (one process per GPU or per share of the cores,
each with its own GIL) or on other hosts. `app.py` lists the routes both sides agree
on; `supervisor.py` runs N workers for `kvgate serve --workers N`.
"""
