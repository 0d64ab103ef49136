"""Analytic cost model of a Cube/Vector NPU (numpy only)."""
from cost_model.devices import DEVICES, Device, devices, get_device

__all__ = ["DEVICES", "Device", "devices", "get_device"]
