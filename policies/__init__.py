"""mixfleet policies package."""
