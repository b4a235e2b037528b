"""mixfleet controlplane package."""
