"""Conformance suite: mixfleet exports and models checked against the engines' own code."""
