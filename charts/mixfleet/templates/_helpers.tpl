{{/* Chart name, truncated to 63 characters. */}}
{{- define "mixfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name; a release named like the chart is not repeated. */}}
{{- define "mixfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "mixfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "mixfleet.labels" -}}
helm.sh/chart: {{ include "mixfleet.chart" . }}
app.kubernetes.io/name: {{ include "mixfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mixfleet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include "mixfleet.selectorLabels" (dict "ctx" . "component" "controller") */}}
{{- define "mixfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mixfleet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "mixfleet.controllerName" -}}
{{- printf "%s-controller" (include "mixfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mixfleet.agentName" -}}
{{- printf "%s-agent" (include "mixfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mixfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mixfleet.controllerName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mixfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* In-cluster DNS name of the controller Service (what agents dial and certificates name). */}}
{{- define "mixfleet.controllerHost" -}}
{{- printf "%s.%s.svc" (include "mixfleet.controllerName" .) .Release.Namespace -}}
{{- end -}}

{{- define "mixfleet.controllerTLSSecret" -}}
{{- if eq .Values.tls.mode "certManager" -}}
{{- printf "%s-tls" (include "mixfleet.controllerName" .) -}}
{{- else -}}
{{- .Values.tls.secret.controller -}}
{{- end -}}
{{- end -}}

{{- define "mixfleet.agentTLSSecret" -}}
{{- if eq .Values.tls.mode "certManager" -}}
{{- printf "%s-tls" (include "mixfleet.agentName" .) -}}
{{- else -}}
{{- .Values.tls.secret.agent -}}
{{- end -}}
{{- end -}}

{{/* Issuer reference of the chart's certificates. */}}
{{- define "mixfleet.issuerRef" -}}
{{- if .Values.tls.certManager.issuerRef -}}
{{- toYaml .Values.tls.certManager.issuerRef -}}
{{- else -}}
name: {{ include "mixfleet.fullname" . }}-ca
kind: Issuer
group: cert-manager.io
{{- end -}}
{{- end -}}

{{/*
RBAC rules of each component, from the API calls in its code (tests/operators/test_rbac.py
reads them from the source and checks that the rendered roles grant exactly these).
Namespaced rules of the operator: ModelDeployments (finalizer patch, status, and the
engine instances' ModelDeployments it creates and deletes), the PartitionPlans it creates
and prunes, its engine ConfigMaps and the version counter.
*/}}
{{- define "mixfleet.operatorNamespacedRules" -}}
- apiGroups: [mixfleet.io]
  resources: [modeldeployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [mixfleet.io]
  resources: [modeldeployments/status]
  verbs: [patch]
- apiGroups: [mixfleet.io]
  resources: [partitionplans]
  verbs: [list, watch, create, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, delete]
{{- end -}}

{{/*
Namespaced rules of the controller in its store namespace: ModelDeployments it is asked to
apply or delete, PartitionPlans it rolls out (their status: state and acks), the committed
pointer, its id and load-window ConfigMaps. PartitionPlans are immutable: no update.
*/}}
{{- define "mixfleet.controllerNamespacedRules" -}}
- apiGroups: [mixfleet.io]
  resources: [modeldeployments]
  verbs: [get, list, create, patch, delete]
- apiGroups: [mixfleet.io]
  resources: [modeldeployments/status, partitionplans/status]
  verbs: [patch]
- apiGroups: [mixfleet.io]
  resources: [partitionplans]
  verbs: [get, list]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, create, patch]
{{- end -}}
