{{/* Labels on every object: the kustomize base's part-of, plus Helm's own. */}}
{{- define "pdd.labels" -}}
app.kubernetes.io/part-of: pdd
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pdd.selector" -}}
app.kubernetes.io/name: {{ .Values.operatorName }}
{{- end -}}

{{- define "pdd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Namespaces a namespaced operator watches: the release namespace unless listed. */}}
{{- define "pdd.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{ .Values.watchNamespaces | uniq | join "," }}
{{- else -}}
{{ .Release.Namespace }}
{{- end -}}
{{- end -}}

{{- define "pdd.webhookConfigName" -}}
{{- if .Values.webhook.configName -}}
{{ .Values.webhook.configName }}
{{- else if .Values.namespaced -}}
{{ printf "pdd-operator.%s.serving.pdd.dev" .Release.Namespace }}
{{- end -}}
{{- end -}}

{{/* The configuration's name as the operator will use it (its default in cluster mode). */}}
{{- define "pdd.webhookConfigNameResolved" -}}
{{- include "pdd.webhookConfigName" . | default "pdd-operator.serving.pdd.dev" -}}
{{- end -}}

{{/* The operator fills in the chart's webhook configuration and may touch no other. */}}
{{- define "pdd.webhookRule" -}}
- apiGroups: [admissionregistration.k8s.io]
  resources: [validatingwebhookconfigurations]
  resourceNames: [{{ include "pdd.webhookConfigNameResolved" . }}]   # shipped here; no create
  verbs: [get, patch]
{{- end -}}

{{/* Namespaced rules: what the operator does to a PDDeployment's namespace. */}}
{{- define "pdd.namespacedRules" -}}
- apiGroups: [serving.pdd.dev]
  resources: [pddeployments]
  verbs: [get, list, watch, patch]          # patch: kopf's finalizer for the periodic timer
- apiGroups: [serving.pdd.dev]
  resources: [pddeployments/status]
  verbs: [get, patch]
- apiGroups: [serving.pdd.dev]
  resources: [pddeployments/finalizers]
  verbs: [update]                           # ownerReferences with blockOwnerDeletion
- apiGroups: [serving.pdd.dev]
  resources: [pddrolescales]
  verbs: [get, list, watch, patch]          # patch: spec.replicas filled in when left out
- apiGroups: [serving.pdd.dev]
  resources: [pddrolescales/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [pods, services, configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]   # roles whose TP spans pods (docs/lws.md)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, watch, create]         # the grant key: created once, read as metadata only
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]                    # patch: a repeated event bumps its count
{{- end -}}
