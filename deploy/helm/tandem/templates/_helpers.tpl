{{/* The labels of every object, and of a component's pods. */}}
{{- define "tandem.labels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "tandem.selector" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The pod settings all three binaries share: non-root, read-only, no service links. */}}
{{- define "tandem.podSecurity" -}}
serviceAccountName: {{ .Release.Name }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- end }}

{{- define "tandem.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: [ALL]
{{- end }}

{{/* Spread a component's pods over nodes. */}}
{{- define "tandem.antiAffinity" -}}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "tandem.selector" . | nindent 14 }}
{{- end }}

{{- define "tandem.modelVolume" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim | default (printf "%s-models" .Release.Name) }}
    readOnly: true
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}

{{- define "tandem.modelMounts" -}}
- name: models
  mountPath: /models
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* The Secret holding the router's key file, if keys are configured. */}}
{{- define "tandem.apiKeysSecret" -}}
{{- if .Values.apiKeys.existingSecret -}}
{{ .Values.apiKeys.existingSecret }}
{{- else if .Values.apiKeys.keys -}}
{{ .Release.Name }}-api-keys
{{- end -}}
{{- end }}
