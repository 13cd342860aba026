"""The fleet: every configured model, routed, loaded on demand and unloaded inside one memory budget (event loop)."""
