"""Prometheus metrics and OpenTelemetry tracing of the gateway."""
