"""The device side of the federation (``fedfs[device]``): the HTTP client and agent, the
device state, the wire format, DP clipping and secure aggregation.
"""
