{{/*
How the values become what they set in `gpuppetti manifests`' objects. The objects' templates (deviceplugin.yaml,
dra.yaml) and _generated.tpl are rendered by tools/gen_chart.py from the code behind `gpuppetti manifests`; this file
and NOTES.txt are written by hand.
*/}}

{{/* The labels Helm's conventions put on every object, beside `gpuppetti manifests`' own. */}}
{{- define "gpuppetti.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/* repository:tag, repository@digest for a tag that is a digest (sha256:...), or the repository alone. */}}
{{- define "gpuppetti.image" -}}
{{- $tag := .Values.image.tag | toString -}}
{{- if not $tag -}}
{{ .Values.image.repository }}
{{- else if contains ":" $tag -}}
{{ .Values.image.repository }}@{{ $tag }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end }}

{{/* The mode label (but with a preset: its one node is the GPU node), and nodeSelector's labels over it. */}}
{{- define "gpuppetti.nodeSelector" -}}
{{- $selector := dict -}}
{{- if not .Values.preset -}}
{{- $_ := set $selector (include "gpuppetti.modeLabel" .) (include "gpuppetti.modeLabelValue" .) -}}
{{- end -}}
{{- range $key, $value := .Values.nodeSelector -}}
{{- $_ := set $selector $key $value -}}
{{- end -}}
{{- if $selector -}}
{{ toYaml $selector }}
{{- end -}}
{{- end }}

{{/* config.yaml: the preset's, else the config value, else the default (with replicas' time-slicing). */}}
{{- define "gpuppetti.config" -}}
{{- if .Values.preset -}}
{{ include (printf "gpuppetti.preset.%s" .Values.preset) . }}
{{- else if .Values.config -}}
{{ toYaml .Values.config }}
{{- else -}}
{{ include "gpuppetti.defaultConfig" . }}
{{- end -}}
{{- end }}

{{/* What values.schema.json cannot say: the values that do not go together, refused as `gpuppetti manifests`
refuses the same flags. */}}
{{- define "gpuppetti.validate" -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" .Release.Namespace) -}}
{{- fail (printf "the release's namespace %q is not a namespace name: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit" .Release.Namespace) -}}
{{- end -}}
{{- $replicas := not (kindIs "invalid" .Values.replicas) -}}
{{- if eq .Values.mode "dra" -}}
{{- if $replicas -}}
{{- fail "replicas is for the device plugin (mode: deviceplugin); with mode: dra, choose the slicing in the config's dra section (config)" -}}
{{- end -}}
{{- if .Values.labelNode -}}
{{- fail "labelNode is for the device plugin (mode: deviceplugin); with mode: dra, the DRA driver publishes each GPU's attributes in its ResourceSlice" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.config .Values.preset -}}
{{- fail "config and preset are two configs: give one of them" -}}
{{- end -}}
{{- if and .Values.config $replicas -}}
{{- fail "replicas applies to the generated config; set the replicas in config instead" -}}
{{- end -}}
{{- end }}
