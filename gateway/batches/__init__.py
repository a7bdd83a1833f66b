"""The Files and Batch APIs' room (issue 50): the files' store, the batches' rows and
the runner that serves their lines at the lowest priority. The routes find it under
`BATCHES` on the app (gateway.batches.start, which gateway.app calls to start it with the
gateway). The package itself imports nothing: `kvgate usage` and `kvgate batches` take
their one module each without the runner's (aiohttp, the gateway's state, metrics)."""
