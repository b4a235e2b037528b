"""Model: what the model is.

- :mod:`policies.model.architecture` - :class:`~policies.model.architecture.ModelSpec`,
  presets and Hugging Face ``config.json`` parsing;
- :mod:`policies.model.hf_config` - a ``config.json`` document read into a model's fields;
- :mod:`policies.model.model_file` - a mixfleet Model file, for architectures no preset knows.

Pure: no I/O.
"""
