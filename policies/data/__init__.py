"""Data files of the planning core: reference_timings.json, the measured per-operation
timings :mod:`policies.estimate.reference` reads."""
