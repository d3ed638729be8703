"""Bench: what methods and the data path cost (time, memory, parameters), recorded as JSON.

May import anything but the lab and the CLI's entry point.
"""
