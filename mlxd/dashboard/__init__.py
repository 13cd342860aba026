"""The htmx dashboard: server-rendered regions over the engine snapshot (docs/dashboard.md)."""
