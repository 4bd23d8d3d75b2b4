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

{{/* The cluster certificate of a role, mounted whole (renewals reach the files). */}}
{{- define "tandem.tlsMount" -}}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}

{{- define "tandem.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ index .root.Values.tls.secrets .role }}
    defaultMode: 0440
{{- end }}

{{/*
  A worker's probe. Plain: GET /metrics on the gRPC port. With mutual TLS the kubelet has no
  client certificate, so the probe writes one byte that is not TLS and expects the TLS alert
  (record type 0x15) the worker sends once it serves (the kustomize mtls component's probe,
  which says why).
*/}}
{{- define "tandem.workerProbe" -}}
{{- if .root.Values.tls.enabled -}}
exec:
  command:
    - bash
    - -c
    - exec 3<>/dev/tcp/127.0.0.1/{{ .port }} && printf '\0' >&3 && timeout 2 head -c 1 <&3 | od -An -tx1 | grep -qw 15
{{- else -}}
httpGet:
  path: /metrics
  port: grpc
{{- end }}
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
