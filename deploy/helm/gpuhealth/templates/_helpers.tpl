{{/* Names */}}
{{- define "gpuhealth.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuhealth.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "gpuhealth.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "gpuhealth.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpuhealth.labels" -}}
app.kubernetes.io/name: {{ include "gpuhealth.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gpuhealth.selector" -}}
app.kubernetes.io/name: {{ include "gpuhealth.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpuhealth.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/* Secret names: the chart's own unless an existing one is named. */}}
{{- define "gpuhealth.agentTokensSecret" -}}
{{- default (printf "%s-agent-tokens" (include "gpuhealth.fullname" .)) .Values.secrets.agentTokens.existingSecret -}}
{{- end -}}
{{- define "gpuhealth.controllerSecret" -}}
{{- default (printf "%s-controller" (include "gpuhealth.fullname" .)) .Values.secrets.controller.existingSecret -}}
{{- end -}}
{{- define "gpuhealth.statePasswordSecret" -}}
{{- default (include "gpuhealth.controllerSecret" .) .Values.secrets.controller.statePassword.existingSecret -}}
{{- end -}}

{{/*
The DSN the chart writes must not carry the password the password file gives (the
controller would refuse to start), and a password value must not be ignored silently.
*/}}
{{- define "gpuhealth.checkStateDsn" -}}
{{- $password := .Values.secrets.controller.statePassword -}}
{{- $dsn := .Values.secrets.controller.stateDsn -}}
{{- $inDsn := or (regexMatch "(^|\\s)password\\s*=" $dsn) (regexMatch "^postgres(ql)?://[^/@]*:[^/@]*@" $dsn) -}}
{{- if and $password.fromFile $inDsn -}}
{{- fail "gpuhealth: secrets.controller.stateDsn holds a password: take it out and give it as secrets.controller.statePassword.value (a file that rotates), or set secrets.controller.statePassword.fromFile=false for a full DSN" -}}
{{- end -}}
{{- if and (not $password.fromFile) $password.value -}}
{{- fail "gpuhealth: secrets.controller.statePassword.value is set but statePassword.fromFile is false: put the password in stateDsn, or turn fromFile on" -}}
{{- end -}}
{{- end -}}

{{- define "gpuhealth.tlsSecret" -}}
{{- default (printf "%s-controller-tls" (include "gpuhealth.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{- define "gpuhealth.controllerUrl" -}}
{{- printf "https://%s-controller.%s.svc:%d" (include "gpuhealth.fullname" .) .Release.Namespace (int .Values.controller.port) -}}
{{- end -}}

{{- define "gpuhealth.leaseName" -}}
{{- default (printf "%s-controller" (include "gpuhealth.fullname" .)) .Values.controller.lease.name -}}
{{- end -}}

{{/*
TOML from a values tree: one [table] per top-level key, nested maps as inline tables,
whole numbers without a fraction (Helm reads every YAML number as a float).
*/}}
{{- define "gpuhealth.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{- define "gpuhealth.tomlValue" -}}
{{- $v := . -}}
{{- if kindIs "string" $v -}}{{ toJson $v }}
{{- else if kindIs "bool" $v -}}{{ $v }}
{{- else if or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) -}}
{{- if eq (float64 (int64 $v)) (float64 $v) -}}{{ int64 $v }}{{- else -}}{{ $v }}{{- end -}}
{{- else if kindIs "slice" $v -}}[{{ range $i, $e := $v }}{{ if $i }}, {{ end }}{{ include "gpuhealth.tomlValue" $e }}{{ end }}]
{{- else if kindIs "map" $v -}}{ {{ range $i, $k := keys $v | sortAlpha }}{{ if $i }}, {{ end }}{{ include "gpuhealth.tomlKey" $k }} = {{ include "gpuhealth.tomlValue" (index $v $k) }}{{ end }} }
{{- else if kindIs "invalid" $v -}}{{ fail "gpuhealth: a null in the gpuhealth configuration has no TOML form; leave the key out" }}
{{- else -}}{{ fail (printf "gpuhealth: cannot write %v as TOML" $v) }}
{{- end -}}
{{- end -}}

{{- define "gpuhealth.toml" -}}
{{- $tree := . -}}
{{- range $section := keys $tree | sortAlpha }}
{{- $table := index $tree $section }}
[{{ include "gpuhealth.tomlKey" $section }}]
{{- range $key := keys $table | sortAlpha }}
{{ include "gpuhealth.tomlKey" $key }} = {{ include "gpuhealth.tomlValue" (index $table $key) }}
{{- end }}
{{ end -}}
{{- end -}}

{{/* The agent's settings: what the chart wires, then .Values.agent.config over it. */}}
{{- define "gpuhealth.agentSettings" -}}
{{- $wired := dict
  "node" (dict "data_dir" "/var/lib/gpuhealth")
  "metrics" (dict "listen_address" "0.0.0.0" "port" .Values.agent.metricsPort)
  "alerting" (dict "api_enabled" false)
  "agent" (dict "controllers" (list (include "gpuhealth.controllerUrl" .)) "ca_file" "/etc/gpuhealth/tls/ca.crt" "protective_cordon" .Values.agent.protectiveCordon.enabled)
  "collectors" (dict "kernel_log" (dict "type" "kernel_log" "source" .Values.agent.kernelLog.source))
-}}
{{- if .Values.agent.protectiveCordon.enabled }}
{{- $_ := set $wired "remediation" (dict "scheduler" "kubernetes" "scheduler_options" (dict "in_cluster" true) "dry_run" .Values.remediation.dryRun) -}}
{{- end }}
{{- toJson (mergeOverwrite $wired (deepCopy .Values.agent.config)) -}}
{{- end -}}

{{/* The controller's settings: what the chart wires, then .Values.controller.config over it. */}}
{{- define "gpuhealth.controllerSettings" -}}
{{- $wired := dict
  "node" (dict "data_dir" "/var/lib/gpuhealth")
  "alerting" (dict "api_token_env" "GPUHEALTH_API_TOKEN")
  "controller" (dict "listen_address" "0.0.0.0" "port" .Values.controller.port "tls_cert_file" "/etc/gpuhealth/tls/tls.crt" "tls_key_file" "/etc/gpuhealth/tls/tls.key" "agent_tokens_file" "/etc/gpuhealth/agent-tokens/agent-tokens")
  "remediation" (dict "election" "kubernetes" "election_options" (dict "name" (include "gpuhealth.leaseName" .) "namespace" .Release.Namespace "in_cluster" true "ttl_seconds" .Values.controller.lease.ttlSeconds) "scheduler" "kubernetes" "scheduler_options" (dict "in_cluster" true) "dry_run" .Values.remediation.dryRun "cluster_size" .Values.remediation.clusterSize "max_disrupted_fraction" .Values.remediation.maxDisruptedFraction)
-}}
{{- toJson (mergeOverwrite $wired (deepCopy .Values.controller.config)) -}}
{{- end -}}

{{- define "gpuhealth.podSecurity" -}}
seccompProfile:
  type: RuntimeDefault
{{- end -}}
