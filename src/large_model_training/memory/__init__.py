"""Memory: activation accounting (saved-tensor hooks), recomputation policies."""
