"""mixfleet's wire API; the generated stubs live in :mod:`mixfleet.v1`."""
