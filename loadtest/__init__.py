"""`ladder loadtest`: workloads, an OpenAI-compatible streaming client, metrics and reports.

It talks HTTP only and imports nothing of ladder's engine or model, so it measures any
OpenAI-compatible server.
"""
