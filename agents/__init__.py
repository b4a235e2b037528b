"""mixfleet agents package."""
