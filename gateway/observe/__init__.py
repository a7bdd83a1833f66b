"""What the gateway tells about itself: Prometheus metrics and the live traffic
figures behind /admin/stats and `kvgate top`.
"""
