{{/*
Shared names, labels and pod fragments. Every component template uses these, so that
labels, selectors and security settings cannot drift apart.
*/}}

{{- define "gtr.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name when it already contains the chart name.
Truncated to 40 characters: the longest suffix added below is "-shard-NNN-headless". */}}
{{- define "gtr.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gtr.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels common to every resource. */}}
{{- define "gtr.labels" -}}
helm.sh/chart: {{ include "gtr.chart" . }}
app.kubernetes.io/name: {{ include "gtr.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gtr-retrieval
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway"). */}}
{{- define "gtr.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gtr.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component. */}}
{{- define "gtr.componentLabels" -}}
{{ include "gtr.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "gtr.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gtr.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* One of the images (values `images`, as scripts/build_images.sh tags them from
deploy/images.env): (dict "root" $ "key" "app" | "appGpu" | "triton" | "tritonCpu").
<registry>/<name>@<digest> when images.digests has the key, else <registry>/<name>:<tag>. */}}
{{- define "gtr.imageRef" -}}
{{- $i := .root.Values.images }}
{{- $name := get $i .key }}
{{- $digest := get ($i.digests | default dict) .key }}
{{- if $digest }}
{{- printf "%s/%s@%s" $i.registry $name $digest }}
{{- else }}
{{- printf "%s/%s:%s" $i.registry $name (default .root.Chart.AppVersion $i.tag) }}
{{- end }}
{{- end }}

{{/* The application image (gateway, shards, rerank on CPU). */}}
{{- define "gtr.image" -}}
{{- include "gtr.imageRef" (dict "root" . "key" "app") }}
{{- end }}

{{/* Refuse an autoscaler whose minimum exceeds its maximum (JSON Schema cannot compare
two values): (dict "name" "gateway" "hpa" .Values.gateway.autoscaling). */}}
{{- define "gtr.checkAutoscaling" -}}
{{- if and .hpa.enabled (gt (int .hpa.minReplicas) (int .hpa.maxReplicas)) }}
{{- fail (printf "%s.autoscaling: minReplicas %d is above maxReplicas %d" .name (int .hpa.minReplicas) (int .hpa.maxReplicas)) }}
{{- end }}
{{- end }}

{{/* The selected encoder profile (encoder.size must name one of encoder.profiles). */}}
{{- define "gtr.encoderProfile" -}}
{{- $p := get .Values.encoder.profiles .Values.encoder.size }}
{{- if not $p }}
{{- fail (printf "encoder.size %q has no entry in encoder.profiles" .Values.encoder.size) }}
{{- end }}
{{- toYaml $p }}
{{- end }}

{{- define "gtr.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext }}
{{- end }}

{{- define "gtr.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext }}
{{- end }}

{{/* Shard service name: (dict "root" $ "shard" 0). */}}
{{- define "gtr.shardName" -}}
{{- printf "%s-shard-%d" (include "gtr.fullname" .root) (int .shard) }}
{{- end }}

{{/* GTR_GATEWAY_SHARDS: shards separated by ";", replicas of a shard by ",".
With index.gatewayAddressing=service a shard is one dns:/// target of its headless
Service (the gateway re-resolves it and balances over its A records); with "pods" it is the
list of its pods' stable DNS names. These are g1's shards (the gateway's fallback for
g1); other generations' are gtr.generationTargets, recorded in {gtr}:addrs. */}}
{{- define "gtr.shardTargets" -}}
{{- $g1 := dict "name" "g1" }}
{{- range $g := .Values.index.generations }}{{ if eq $g.name "g1" }}{{ $g1 = $g }}{{ end }}{{ end }}
{{- include "gtr.generationTargets" (dict "root" . "gen" $g1) }}
{{- end }}

{{/* The generations of index.generations with their defaults filled in, as YAML
{"items": [{name, shards, replicas, indexDir, first}]}; fails on a g1 whose shard count
is not index.shards, on a name listed twice. */}}
{{- define "gtr.generations" -}}
{{- $root := . }}
{{- $v := .Values.index }}
{{- $items := list }}
{{- $seen := dict }}
{{- range $g := $v.generations }}
{{- if hasKey $seen $g.name }}
{{- fail (printf "index.generations lists %s twice" $g.name) }}
{{- end }}
{{- $_ := set $seen $g.name true }}
{{- $first := eq $g.name "g1" }}
{{- $shards := int ($g.shards | default $v.shards) }}
{{- if and $first (ne $shards (int $v.shards)) }}
{{- fail (printf "index.generations: g1 has %d shards but index.shards is %d: g1 is the store's first generation, and index.shards is its shard count" $shards (int $v.shards)) }}
{{- end }}
{{- $dir := "" }}
{{- if $g.indexDir }}
{{- $dir = $g.indexDir }}
{{- else if $first }}
{{- $dir = ternary "/var/lib/gtr/trained" "/var/lib/gtr/data/index" (not (empty $v.trainedIndex.existingClaim)) }}
{{- else }}
{{- $dir = printf "%s/%s" (trimSuffix "/" $v.generationsVolume.mountPath) $g.name }}
{{- end }}
{{- $items = append $items (dict "name" $g.name "shards" $shards "replicas" (int ($g.replicas | default $v.replicas)) "indexDir" $dir "first" $first) }}
{{- end }}
{{- toYaml (dict "items" $items) }}
{{- end }}

{{/* StatefulSet / Service name of a generation's shard: (dict "root" $ "gen" "g2" "shard" 0).
g1 keeps the names it had before generations existed. */}}
{{- define "gtr.generationShardName" -}}
{{- if eq .gen "g1" }}
{{- include "gtr.shardName" (dict "root" .root "shard" .shard) }}
{{- else }}
{{- printf "%s-%s-shard-%d" (include "gtr.fullname" .root) .gen (int .shard) }}
{{- end }}
{{- end }}

{{/* Value of the gtr-retrieval.io/shard label of a generation's shard: "<s>" for g1 (as
before generations), "<gen>.<s>" otherwise, so that no selector of one generation's
shard matches another generation's pods. */}}
{{- define "gtr.shardLabel" -}}
{{- if eq .gen "g1" }}{{ .shard }}{{ else }}{{ printf "%s.%d" .gen (int .shard) }}{{ end }}
{{- end }}

{{/* A generation's shard addresses in the --shards syntax: (dict "root" $ "gen" (dict
"name" "g2" "shards" 3 "replicas" 2)); shards and replicas default to index's. */}}
{{- define "gtr.generationTargets" -}}
{{- $root := .root }}
{{- $ns := $root.Release.Namespace }}
{{- $v := $root.Values.index }}
{{- $gen := .gen.name }}
{{- $replicas := int (.gen.replicas | default $v.replicas) }}
{{- $targets := list }}
{{- range $s := until (int (.gen.shards | default $v.shards)) }}
{{- $name := include "gtr.generationShardName" (dict "root" $root "gen" $gen "shard" $s) }}
{{- $svc := printf "%s-headless" $name }}
{{- if eq $v.gatewayAddressing "pods" }}
{{- $pods := list }}
{{- range $r := until $replicas }}
{{- $pods = append $pods (printf "%s-%d.%s.%s.svc:%d" $name $r $svc $ns (int $v.port)) }}
{{- end }}
{{- $targets = append $targets (join "," $pods) }}
{{- else }}
{{- $targets = append $targets (printf "dns:///%s.%s.svc:%d" $svc $ns (int $v.port)) }}
{{- end }}
{{- end }}
{{- join ";" $targets }}
{{- end }}

{{/* True when the generations volume is mounted anywhere: a generation other than g1 is
listed, or the rollout Job or the drift watcher runs. */}}
{{- define "gtr.generationsVolumeUsed" -}}
{{- $v := .Values.index }}
{{- $others := false }}
{{- range $g := $v.generations }}{{ if ne $g.name "g1" }}{{ $others = true }}{{ end }}{{ end }}
{{- if or $others $v.rollout.enabled $v.drift.autoRollout.enabled }}true{{ end }}
{{- end }}

{{/* The claim of the generations volume. */}}
{{- define "gtr.generationsClaim" -}}
{{- default (printf "%s-generations" (include "gtr.fullname" .)) .Values.index.generationsVolume.existingClaim }}
{{- end }}

{{/* The arguments of `index rollout` that the Job and the drift watcher share (where the
store, Triton, the model repository and the generations volume are). */}}
{{- define "gtr.rolloutCommonArgs" -}}
- --triton-url={{ printf "dns:///%s-triton-headless.%s.svc:%d" (include "gtr.fullname" .) .Release.Namespace (int .Values.encoder.ports.grpc) }}
- --index-root={{ .Values.index.generationsVolume.mountPath }}
{{- /* --retrain exports the serving generation's vectors from its replicas: g1's are
       not in {gtr}:addrs (the gateway falls back to its --shards), so name them */}}
- --source-shards={{ include "gtr.shardTargets" . }}
{{- with .Values.index.rollout }}
{{- if .batch }}
- --batch={{ .batch }}
{{- end }}
{{- if .sample }}
- --sample={{ .sample }}
{{- end }}
{{- range .extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Host name of the in-release Redis. */}}
{{- define "gtr.redisHost" -}}
{{- printf "%s-redis" (include "gtr.fullname" .) }}
{{- end }}

{{/* The Secret holding the in-release Redis password ("" when AUTH is off): the
user's redis.auth.existingSecret, else the chart's own (templates/redis-secret.yaml). */}}
{{- define "gtr.redisAuthSecret" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.enabled }}
{{- default (printf "%s-redis-auth" (include "gtr.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}
{{- end }}

{{/* Bytes of a Kubernetes memory quantity ("4Gi", "512Mi", "1G", "1000"). */}}
{{- define "gtr.bytes" -}}
{{- $q := toString . }}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 }}
{{- $unit := regexFind "[A-Za-z]+$" $q }}
{{- if and $unit (not (hasKey $units $unit)) }}
{{- fail (printf "memory quantity %q: unit %q is not one of Ki Mi Gi Ti k M G T" $q $unit) }}
{{- end }}
{{- $number := trimSuffix $unit $q }}
{{- if $unit }}
{{- mulf (float64 $number) (get $units $unit) | int64 }}
{{- else }}
{{- $number | float64 | int64 }}
{{- end }}
{{- end }}

{{/* Redis maxmemory in bytes: redis.maxmemoryPercent of the container's memory limit. */}}
{{- define "gtr.redisMaxmemory" -}}
{{- $limit := required "redis.resources.limits.memory is required: maxmemory is derived from it" (.Values.redis.resources.limits).memory }}
{{- div (mul (include "gtr.bytes" $limit | int64) (int .Values.redis.maxmemoryPercent)) 100 }}
{{- end }}

{{/* Env entries giving a process its Redis URL: (dict "root" $ "var" "GTR_GATEWAY_REDIS_URL"). */}}
{{- define "gtr.redisEnv" -}}
{{- $v := .root.Values.redis }}
{{- if $v.enabled }}
{{- if include "gtr.redisAuthSecret" .root }}
- name: GTR_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "gtr.redisAuthSecret" .root }}
      key: {{ $v.auth.passwordKey }}
- name: {{ .var }}
  value: {{ printf "redis://:$(GTR_REDIS_PASSWORD)@%s:%d/0" (include "gtr.redisHost" .root) (int $v.port) | quote }}
{{- else }}
- name: {{ .var }}
  value: {{ printf "redis://%s:%d/0" (include "gtr.redisHost" .root) (int $v.port) | quote }}
{{- end }}
{{- else if $v.external.existingSecret }}
- name: {{ .var }}
  valueFrom:
    secretKeyRef:
      name: {{ $v.external.existingSecret }}
      key: {{ $v.external.urlKey }}
{{- else }}
- name: {{ .var }}
  value: {{ required "redis.external.url (or redis.external.existingSecret) is required when redis.enabled is false" $v.external.url | quote }}
{{- end }}
{{- end }}

{{/* True when a Secret is passed through env (checkov CKV_K8S_35 is then suppressed with a reason). */}}
{{- define "gtr.redisUsesSecretEnv" -}}
{{- if or (include "gtr.redisAuthSecret" .) (and (not .Values.redis.enabled) .Values.redis.external.existingSecret) }}true{{- end }}
{{- end }}

{{/* Checkov suppressions shared by the gtr-retrieval pods (each with its reason). */}}
{{- define "gtr.checkovAppAnnotations" -}}
checkov.io/skip1: CKV_K8S_43=Images are pinned by immutable release tag; set image.digest to pull by digest.
checkov.io/skip2: CKV_K8S_15=Release tags are immutable, so IfNotPresent is as safe as Always and avoids registry load on every start.
{{- if include "gtr.redisUsesSecretEnv" . }}
checkov.io/skip3: CKV_K8S_35=The Redis client takes its URL from the environment; the Secret is referenced, never inlined.
{{- end }}
{{- end }}

{{/* Volumes every gtr-retrieval container needs with a read-only root file system. */}}
{{- define "gtr.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 256Mi
{{- end }}

{{/* Common process settings of one service: (dict "root" $ "prefix" "GTR_GATEWAY" "cfg" .Values.gateway). */}}
{{- define "gtr.processConfig" -}}
{{ .prefix }}_HOST: "0.0.0.0"
{{ .prefix }}_PORT: {{ .cfg.port | quote }}
{{ .prefix }}_METRICS_PORT: {{ .cfg.metricsPort | quote }}
{{ .prefix }}_LOG_FORMAT: {{ .root.Values.logging.format | quote }}
{{ .prefix }}_LOG_LEVEL: {{ .root.Values.logging.level | quote }}
{{ .prefix }}_GRACE_SECONDS: {{ .cfg.graceSeconds | quote }}
{{- range $k, $v := .cfg.extraEnv }}
{{ $k }}: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/* Bearer tokens (docs/deploy.md, "Authentication"): required unless auth.enabled is
false; from auth.existingSecret (keys read-tokens, write-tokens) or the Secret the chart
makes of auth.readTokens / auth.writeTokens. */}}
{{- define "gtr.authSecretName" -}}
{{- if .Values.auth.existingSecret -}}
{{ .Values.auth.existingSecret }}
{{- else -}}
{{ include "gtr.fullname" . }}-tokens
{{- end -}}
{{- end }}

{{- define "gtr.checkAuth" -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) (not .Values.auth.readTokens) (not .Values.auth.writeTokens) -}}
{{- fail "auth.enabled is true (the default) but no tokens are given: set auth.existingSecret (a Secret with the keys read-tokens and write-tokens, one token per line) or auth.readTokens / auth.writeTokens; or set auth.enabled=false to run the gateway without authentication (docs/deploy.md)" -}}
{{- end -}}
{{- end }}

{{/* Env of a process for auth and TLS: (dict "root" . "prefix" "GTR_GATEWAY" "component"
"gateway"). Certificates come from the tls.existingSecret (tls.crt, tls.key, ca.crt);
with TLS the gRPC probes use the plaintext health-only port (tls.healthPort). Triton
stays plaintext (the gateway's GTR_GATEWAY_TRITON_TLS=false). */}}
{{- define "gtr.securityEnv" -}}
{{- $root := .root -}}
{{- $p := .prefix -}}
{{- $gateway := eq .component "gateway" -}}
{{- if and $gateway $root.Values.auth.enabled }}
- name: {{ $p }}_READ_TOKENS_FILE
  value: /etc/gtr/tokens/read-tokens
- name: {{ $p }}_WRITE_TOKENS_FILE
  value: /etc/gtr/tokens/write-tokens
{{- else if $gateway }}
- name: {{ $p }}_AUTH
  value: "false"
{{- end }}
{{- if $root.Values.tls.enabled }}
- name: {{ $p }}_TLS_CERT
  value: /etc/gtr/tls/tls.crt
- name: {{ $p }}_TLS_KEY
  value: /etc/gtr/tls/tls.key
- name: {{ $p }}_HEALTH_PORT
  value: {{ $root.Values.tls.healthPort | quote }}
{{- if or (and (not $gateway) $root.Values.tls.mutual) (and $gateway $root.Values.tls.clientAuth) }}
- name: {{ $p }}_TLS_CLIENT_CA
  value: /etc/gtr/tls/ca.crt
{{- end }}
{{- /* Its own connections: the gateway's to shards and rerank, a shard's to the peer it
       seeds a snapshot from (--peers, the shard's headless Service). */}}
{{- if or $gateway (eq .component "index") }}
- name: {{ $p }}_TLS_CA
  value: /etc/gtr/tls/ca.crt
{{- if $root.Values.tls.mutual }}
- name: {{ $p }}_TLS_CLIENT_CERT
  value: /etc/gtr/tls/tls.crt
- name: {{ $p }}_TLS_CLIENT_KEY
  value: /etc/gtr/tls/tls.key
{{- end }}
{{- end }}
{{- if $gateway }}
- name: {{ $p }}_TRITON_TLS
  value: "false"
{{- end }}
{{- end }}
{{- end }}

{{- define "gtr.securityMounts" -}}
{{- if and (eq .component "gateway") .root.Values.auth.enabled }}
- name: tokens
  mountPath: /etc/gtr/tokens
  readOnly: true
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  mountPath: /etc/gtr/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* No subPath: the kubelet updates a mounted Secret in place, and the gateway re-reads
its token files when they change (rotation without a restart). */}}
{{- define "gtr.securityVolumes" -}}
{{- if and (eq .component "gateway") .root.Values.auth.enabled }}
- name: tokens
  secret:
    secretName: {{ include "gtr.authSecretName" .root }}
    defaultMode: 0440
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.existingSecret is required when tls.enabled is true" .root.Values.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "gtr.probePort" -}}
{{- if .root.Values.tls.enabled -}}
{{ .root.Values.tls.healthPort }}
{{- else -}}
{{ .port }}
{{- end -}}
{{- end }}

{{/* The Triton ConfigMap: everything the Triton pods read (their env and the init
script), and all their checksum/config hashes (templates/triton.yaml). */}}
{{- define "gtr.tritonConfigMap" -}}
{{- $profile := include "gtr.encoderProfile" . | fromYaml -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "gtr.fullname" . }}-triton
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "gtr.componentLabels" (dict "root" . "component" "triton") | nindent 4 }}
data:
  encoder-size: {{ .Values.encoder.size | quote }}
  encoder-flavor: {{ .Values.encoder.flavor | quote }}
  slo-ms: {{ $profile.sloMs | quote }}
  instance-count: {{ $profile.instanceCount | quote }}
  prepare_model_repository.py: |
    {{- .Files.Get "files/prepare_model_repository.py" | nindent 4 }}
{{- end }}

{{/*
OpenTelemetry (docs/tracing.md): where the gateway, a shard replica or the reranker sends
its spans and how many it records, as the OpenTelemetry environment variables the
services read (--otlp-endpoint / --trace-sample-ratio when unset). Nothing when
tracing.otlpEndpoint is empty: tracing off.
*/}}
{{- define "gtr.tracingEnv" -}}
{{- $t := .Values.tracing -}}
{{- if $t.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $t.otlpEndpoint | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $t.sampleRatio | toString | quote }}
{{- end }}
{{- end }}

{{/*
Triton's OpenTelemetry flags (services/encoder/serve/triton_server.py trace_args): OTLP
over HTTP to tracing.tritonOtlpEndpoint, 1 inference in round(1/sampleRatio) traced.
*/}}
{{- define "gtr.tritonTraceArgs" -}}
{{- $t := .Values.tracing -}}
{{- if and $t.tritonOtlpEndpoint (gt (float64 $t.sampleRatio) 0.0) }}
- --trace-config=mode=opentelemetry
- --trace-config=opentelemetry,url={{ $t.tritonOtlpEndpoint }}
- --trace-config=opentelemetry,resource=service.name=triton
- --trace-config=rate={{ max 1 (round (divf 1.0 (float64 $t.sampleRatio)) 0) | int }}
- --trace-config=count=-1
- --trace-config=level=TIMESTAMPS
{{- end }}
{{- end }}
