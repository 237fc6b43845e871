{{/*
Names and labels. The objects are named after the release, so that
`helm install ciuicd ...` gives the names of deploy/kubernetes/manifests/ (ciuicd,
ciuicd-config, ciuicd-metrics).
*/}}
{{- define "ciuic.fullname" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ciuic.selectorLabels" -}}
app.kubernetes.io/name: ciuic
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: daemon
{{- end -}}

{{- define "ciuic.labels" -}}
{{ include "ciuic.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ciuic.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "ciuic.tokenSecret" -}}
{{- .Values.clusterToken.existingSecret | default (printf "%s-cluster-token" (include "ciuic.fullname" .)) -}}
{{- end -}}

{{/*
The port of a "host:port" config value ("" when there is none), so that the
declared container ports follow the config.
*/}}
{{- define "ciuic.portOf" -}}
{{- regexFind "[0-9]+$" (toString .) -}}
{{- end -}}

{{/* The peer service's port: `listen` "auto" is port 7361, "off" none. */}}
{{- define "ciuic.peerPort" -}}
{{- $listen := toString .Values.config.listen -}}
{{- if eq $listen "auto" -}}7361
{{- else if ne $listen "off" -}}{{ include "ciuic.portOf" $listen }}
{{- end -}}
{{- end -}}

{{/*
A ciuicd size (a plain number of bytes or one with the suffix K, M, G or T,
as deploy/ciuicd.yaml says) in MiB, rounded up.
*/}}
{{- define "ciuic.mebibytes" -}}
{{- $bytes := 0 -}}
{{- if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{- $bytes = int64 . -}}
{{- else -}}
{{- $text := toString . | trim -}}
{{- $digits := regexFind "^[0-9]+" $text -}}
{{- $suffix := trimPrefix $digits $text -}}
{{- $scale := dict "" 1 "K" 1024 "M" 1048576 "G" 1073741824 "T" 1099511627776 -}}
{{- if or (not $digits) (not (hasKey $scale $suffix)) -}}
{{- fail (printf "%q is not a ciuicd size (bytes, or a number with K, M, G or T)" $text) -}}
{{- end -}}
{{- $bytes = mul (int64 $digits) (get $scale $suffix) -}}
{{- end -}}
{{- div (add $bytes 1048575) 1048576 -}}
{{- end -}}

{{/*
The daemon container's memory request and limit, in MiB (values.yaml,
`resources`, explains each term): every session's arena is charged to this
container's memory cgroup, so the limit is computed from the config's caps.
*/}}
{{- define "ciuic.memoryMi" -}}
{{- $total := .Values.config.max_arena_bytes_total | default 0 -}}
{{- $totalMi := include "ciuic.mebibytes" $total | int64 -}}
{{- if eq $totalMi 0 -}}
{{- fail "config.max_arena_bytes_total must be set (not 0): 0 means 3/4 of the host's memory, which the pod's memory limit does not follow" -}}
{{- end -}}
{{- $sessions := .Values.config.max_sessions | default 4096 | int64 -}}
{{- add $totalMi (mul $sessions 65) (.Values.resources.workingMemoryMi | int64) -}}
{{- end -}}
