"""The fleet: every configured model, loaded on demand inside one memory budget."""
