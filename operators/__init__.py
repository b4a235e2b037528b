"""mixfleet on Kubernetes: the mixfleet.io/v1alpha1 CRDs (declared once in
:mod:`apis.kube.v1alpha1`, generated into the Helm chart by :mod:`operators.crdgen`), the
ModelDeployment operator (:mod:`operators.decide` decides, :mod:`operators.act` acts,
:mod:`operators.operator` runs the loop) and Lease-based leader election
(:mod:`apis.kube.leader`, shared with the controller)."""
