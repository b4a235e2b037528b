"""Test support for the operator: an in-process fake of the Kubernetes API server
(:mod:`operators.testing.fakeapi`) that the official Python client talks to over HTTP."""
