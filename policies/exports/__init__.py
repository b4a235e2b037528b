"""Exports: the files inference engines load from a plan.

- :mod:`policies.exports.engine` - each engine's expert-placement file and its checks;
- :mod:`policies.exports.manifest` - the manifest beside it: what the engine file cannot say.

Pure: no I/O.
"""
