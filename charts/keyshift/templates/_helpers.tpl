{{/* Name of the chart (or nameOverride). */}}
{{- define "keyshift.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects: the release name if it contains the chart name, else
"<release>-<chart>"; at most 63 characters.
*/}}
{{- define "keyshift.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "keyshift.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "keyshift.selectorLabels" -}}
app.kubernetes.io/name: {{ include "keyshift.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
The operator pods' selector labels as key=value,key=value: the operator's
--operator-pod-labels, the `from` of the NetworkPolicy it puts in front of each job's workers.
*/}}
{{- define "keyshift.operatorPodLabels" -}}
{{- $pairs := list }}
{{- range $k, $v := include "keyshift.selectorLabels" . | fromYaml }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{- define "keyshift.labels" -}}
helm.sh/chart: {{ include "keyshift.chart" . }}
{{ include "keyshift.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: keyshift
{{- end }}

{{- define "keyshift.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "keyshift.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository@digest, or repository:tag (tag defaults to appVersion). */}}
{{- define "keyshift.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
What the operator may do with the StreamJobs, pods, secrets, events and NetworkPolicies of a
watched namespace
(or of all namespaces): exactly the operator's documented API use, no wildcards.
*/}}
{{- define "keyshift.workloadRules" -}}
- apiGroups: ["keyshift.dev"]
  resources: ["streamjobs"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["keyshift.dev"]
  resources: ["streamjobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["keyshift.dev"]
  resources: ["streamjobs/finalizers"]
  verbs: ["update"]
# StreamJobSnapshots: their status, their file-disposing finalizer, and deleting those a job's
# spec.snapshotRetention retires.
- apiGroups: ["keyshift.dev"]
  resources: ["streamjobsnapshots"]
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["keyshift.dev"]
  resources: ["streamjobsnapshots/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["keyshift.dev"]
  resources: ["streamjobsnapshots/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# The job's control-token Secret: created once, then read by name (src/operator/pods.rs). Its
# owner reference to the StreamJob lets the garbage collector delete it; the operator never lists,
# watches, changes or deletes a Secret.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.networkPolicy.enabled }}
# The NetworkPolicy in front of each job's workers: server-side applied (create, patch) before
# the job's pods are created; never read, listed or deleted (it goes with its StreamJob).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch"]
{{- end }}
{{- end }}

{{/* A memory quantity in bytes ("64Mi", "1Gi", "500M", "1048576"), or "" when it is not a
whole number with one of those suffixes (a fraction such as "1.5Gi" is not checked). */}}
{{- define "keyshift.bytes" -}}
{{- $q := toString . }}
{{- if regexMatch "^[0-9]+(Ki|Mi|Gi|Ti|k|K|M|G|T)?$" $q }}
{{- $n := regexFind "^[0-9]+" $q }}
{{- $unit := trimPrefix $n $q }}
{{- $mul := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 }}
{{- mul (int64 $n) (get $mul $unit) }}
{{- end }}
{{- end }}

{{/* Fails rendering on value combinations the schema cannot express. */}}
{{- define "keyshift.validate" -}}
{{- $limit := include "keyshift.bytes" (dig "limits" "memory" "" .Values.resources) }}
{{- $budget := include "keyshift.bytes" .Values.rewrite.memory }}
{{- if and $limit $budget (gt (mul (int64 $budget) 2) (int64 $limit)) }}
{{- fail (printf "rewrite.memory (%s) must be at most half of resources.limits.memory (%s): a key-group rewrite holds up to rewrite.memory beside the operator's own memory, and a container over its limit is killed mid-rewrite. Raise resources.limits.memory or lower rewrite.memory" (toString .Values.rewrite.memory) (toString .Values.resources.limits.memory)) }}
{{- end }}
{{- if and (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) }}
{{- fail "replicas > 1 needs leaderElection.enabled: true (only one operator may reconcile at a time)" }}
{{- end }}
{{- range .Values.extraVolumes }}
{{- if eq .name "tmp" }}
{{- fail "extraVolumes: the name \"tmp\" is the chart's own (the operator's /tmp); choose another name" }}
{{- end }}
{{- end }}
{{- $volumes := list "tmp" }}
{{- range .Values.extraVolumes }}{{ $volumes = append $volumes .name }}{{ end }}
{{- range .Values.extraVolumeMounts }}
{{- if not (has .name $volumes) }}
{{- fail (printf "extraVolumeMounts: %q mounts volume %q, which extraVolumes does not declare" .mountPath .name) }}
{{- end }}
{{- if eq (clean .mountPath) "/tmp" }}
{{- fail "extraVolumeMounts: /tmp is the chart's own mount (a writable emptyDir on the read-only root filesystem); mount elsewhere" }}
{{- end }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) }}
{{- fail "serviceMonitor.enabled is true but the cluster does not serve monitoring.coreos.com/v1 ServiceMonitor: install the Prometheus Operator CRDs first (with `helm template`, pass --api-versions monitoring.coreos.com/v1/ServiceMonitor)" }}
{{- end }}
{{- end }}
