"""Data files of the planning core: reference_timings.json, the measured per-operation
timings :mod:`policies.reference` reads."""
