"""OpenTelemetry traces and metrics (the ``otel`` extra), enabled with
``open_registry(..., telemetry=OpenTelemetry())``.

A plug-in: it imports the core, and nothing in the core imports it.
"""

from ._telemetry import METRICS as METRICS
from ._telemetry import OpenTelemetry as OpenTelemetry

__all__ = ["METRICS", "OpenTelemetry"]
