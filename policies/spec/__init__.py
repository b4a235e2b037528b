"""The deployment spec: what a user asks mixfleet to serve.

- :mod:`policies.spec.types` - :class:`~policies.spec.types.DeploymentSpec` and its parts;
- :mod:`policies.spec.document` - the ModelDeployment document (YAML, CRD, protobuf) read
  into it, every field checked;
- :mod:`policies.spec.check` - the checks across fields, and what they resolve;
- :mod:`policies.spec.build` - the one way a spec becomes a solve
  (:func:`~policies.spec.build.build_request`).

Pure: no I/O.
"""
