{{/* Rendered by tools/gen_chart.py (`make deploy`). Edit the generator, not this. */}}

{{/* plugin or dra. deviceplugin, the chart's old spelling of plugin, still means plugin (NOTES.txt says
so). */}}
{{- define "gpuppetti.mode" -}}
{{- if eq .Values.mode "deviceplugin" -}}plugin{{- else -}}{{ .Values.mode }}{{- end -}}
{{- end }}

{{/* The mode's DaemonSet. */}}
{{- define "gpuppetti.name" -}}
{{- if eq (include "gpuppetti.mode" .) "dra" -}}gpuppetti-dra{{- else -}}gpuppetti-device-plugin{{- end -}}
{{- end }}

{{/* The node label that says which mode a node runs. */}}
{{- define "gpuppetti.modeLabel" -}}gpuppetti.dev/mode{{- end }}

{{/* The labels Helm's conventions add to each object's own (not to the pods': an upgrade that changes nothing
rolls no pod). */}}
{{- define "gpuppetti.helmLabels" -}}
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
{{- $_ := set $selector (include "gpuppetti.modeLabel" .) (include "gpuppetti.mode" .) -}}
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

{{/* The config when none is given: whole GPUs; with replicas above 1, that many time-sliced replicas of every
GPU, under each vendor's resource name (`gpuppetti manifests --replicas`). */}}
{{- define "gpuppetti.defaultConfig" -}}
version: v1
{{- if gt (int (.Values.replicas | default 0)) 1 }}
sharing:
  timeSlicing:
    resources:
{{- range list "apple.com/gpu" "nvidia.com/gpu" "amd.com/gpu" "gpu.intel.com/i915" "gpuppetti.dev/gpu" }}
      - name: {{ . }}
        replicas: {{ $.Values.replicas }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpuppetti.preset.minikube-krunkit" -}}
version: v1
backend: drm
virtio:
  vendor: apple
# The Mac's own facts (model, cores, memory), from `gpuppetti host-agent` on the Mac, once its token is in
# the gpuppetti-host-agent Secret; until then the plugin serves the virtio GPU as configured here.
hostAgent:
  url: http://host.minikube.internal:9410
sharing:
  timeSlicing:
    resources:
      - name: apple.com/gpu
        replicas: {{ .Values.replicas | default 4 }}
{{- end }}

{{/* What values.schema.json cannot say: the values that do not go together, refused as `gpuppetti manifests`
refuses the same flags, and a release namespace that is no namespace name. */}}
{{- define "gpuppetti.validate" -}}
{{- $replicas := not (kindIs "invalid" .Values.replicas) -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" .Release.Namespace) -}}
{{- fail (printf "the release's namespace %q is not a namespace name: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit" .Release.Namespace) -}}
{{- end -}}
{{- if and (eq .Values.mode "dra") $replicas -}}
{{- fail "replicas is for the device plugin (mode: plugin); with mode: dra, choose the slicing in the config's dra section (config)" -}}
{{- end -}}
{{- if and (eq .Values.mode "dra") .Values.labelNode -}}
{{- fail "labelNode is for the device plugin (mode: plugin); with mode: dra, the DRA driver publishes each GPU's attributes in its ResourceSlice" -}}
{{- end -}}
{{- if and .Values.config .Values.preset -}}
{{- fail "config and preset are two configs: give one of them" -}}
{{- end -}}
{{- if and .Values.config $replicas -}}
{{- fail "replicas applies to the generated config; set the replicas in config instead" -}}
{{- end -}}
{{- include "gpuppetti.layerDir" . -}}
{{- end }}
