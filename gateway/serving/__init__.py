"""One completion request from a validated body to its usage row: admission (render,
plan, quota, route), the Job that streams the backend's chunks, the meter that counts
them, tool calls and echo, and the fair queue in front of backends kvgate does not
schedule.
"""
