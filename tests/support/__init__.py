"""The suite's shared cases, checks and helpers (not tests themselves)."""
