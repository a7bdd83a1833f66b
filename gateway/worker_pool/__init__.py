"""`kvgate serve --workers N`: the gateway's engines as supervised `kvgate worker`
processes: where each runs (placement), keeping them alive (supervisor), and the pool
the gateway starts and stops (pool). The child process itself is gateway.worker.
"""
