"""mixfleet operators package."""
