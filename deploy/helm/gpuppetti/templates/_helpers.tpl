{{/*
The named templates the objects share. Each object has a file of its own (configmap.yaml, daemonset.yaml...); what
they render is what `gpuppetti manifests` renders for the same choices, which tests/unit/test_helm_chart.py checks
object by object.
*/}}

{{/* plugin or dra. deviceplugin, the chart's old spelling of plugin, still means plugin (NOTES.txt says so). */}}
{{- define "gpuppetti.mode" -}}
{{- if eq .Values.mode "deviceplugin" -}}plugin{{- else -}}{{ .Values.mode }}{{- end -}}
{{- end }}

{{/* The mode's component, and the name of its DaemonSet, ServiceAccount and RBAC. */}}
{{- define "gpuppetti.component" -}}
{{- if eq (include "gpuppetti.mode" .) "dra" -}}dra{{- else -}}device-plugin{{- end -}}
{{- end }}

{{- define "gpuppetti.name" -}}gpuppetti-{{ include "gpuppetti.component" . }}{{- end }}

{{/* The node label that says which mode a node runs: gpuppetti.dev/mode=plugin or =dra. */}}
{{- define "gpuppetti.modeLabel" -}}gpuppetti.dev/mode{{- end }}

{{/* The labels that select the DaemonSet's pods. */}}
{{- define "gpuppetti.selectorLabels" -}}
app.kubernetes.io/name: gpuppetti
app.kubernetes.io/component: {{ include "gpuppetti.component" . }}
{{- end }}

{{/* The pods' labels: no Helm labels, so that an upgrade that changes nothing rolls no pod. */}}
{{- define "gpuppetti.podLabels" -}}
app.kubernetes.io/name: gpuppetti
app.kubernetes.io/part-of: gpuppetti
app.kubernetes.io/component: {{ include "gpuppetti.component" . }}
{{- end }}

{{/* Every object's labels: the pods' and those Helm's conventions add. */}}
{{- define "gpuppetti.labels" -}}
{{ include "gpuppetti.podLabels" . }}
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

{{/* The ServiceAccount the DaemonSet runs as: the DRA driver's, or the device plugin's that labels nodes; none
otherwise. */}}
{{- define "gpuppetti.serviceAccount" -}}
{{- if or (eq (include "gpuppetti.mode" .) "dra") .Values.labelNode -}}
{{ include "gpuppetti.name" . }}
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

{{/* minikube --driver krunkit on an Apple silicon Mac (`gpuppetti manifests --preset minikube-krunkit`). */}}
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

{{/* The DRA driver's name, which its DeviceClasses select by, and the CEL of its devices' attributes. */}}
{{- define "gpuppetti.driver" -}}gpu.gpuppetti.dev{{- end }}
{{- define "gpuppetti.ours" -}}device.driver == '{{ include "gpuppetti.driver" . }}'{{- end }}
{{- define "gpuppetti.attributes" -}}device.attributes['{{ include "gpuppetti.driver" . }}']{{- end }}

{{/* A DeviceClass of the DRA driver (mode: dra only). Takes a dict: root (the chart's context), name, expression
(CEL), and resource: the extended resource a pod may ask for in its limits to be served by DRA where no device plugin
advertises it (DRAExtendedResource), or none. */}}
{{- define "gpuppetti.deviceClass" -}}
{{- if eq (include "gpuppetti.mode" .root) "dra" }}
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: {{ .name }}
  labels:
    {{- include "gpuppetti.labels" .root | nindent 4 }}
spec:
  selectors:
    - cel:
        expression: {{ .expression | quote }}
  {{- with .resource }}
  extendedResourceName: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/* The whole GPUs of some vendors, as the DeviceClass named after the vendor's resource. Takes a dict: root,
vendor (the class's name before the driver's), resource, and vendors (the values of the vendor attribute). */}}
{{- define "gpuppetti.vendorDeviceClass" -}}
{{- $attributes := include "gpuppetti.attributes" .root -}}
{{- $vendors := list -}}
{{- range .vendors -}}
{{- $vendors = append $vendors (printf "%s.vendor == '%s'" $attributes .) -}}
{{- end -}}
{{- $whole := printf "('byDefault' in %s ? %s.byDefault : (!('partitions' in %s) || %s.partitions == 1))" $attributes $attributes $attributes $attributes -}}
{{- include "gpuppetti.deviceClass" (dict "root" .root "name" (printf "%s.%s" .vendor (include "gpuppetti.driver" .root))
      "resource" .resource
      "expression" (printf "%s && (%s) && %s" (include "gpuppetti.ours" .root) (join " || " $vendors) $whole)) -}}
{{- end }}

{{/* What values.schema.json cannot say: the values that do not go together, refused as `gpuppetti manifests`
refuses the same flags, and a release namespace that is no namespace name. */}}
{{- define "gpuppetti.validate" -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" .Release.Namespace) -}}
{{- fail (printf "the release's namespace %q is not a namespace name: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit" .Release.Namespace) -}}
{{- end -}}
{{- $replicas := not (kindIs "invalid" .Values.replicas) -}}
{{- if eq .Values.mode "dra" -}}
{{- if $replicas -}}
{{- fail "replicas is for the device plugin (mode: plugin); with mode: dra, choose the slicing in the config's dra section (config)" -}}
{{- end -}}
{{- if .Values.labelNode -}}
{{- fail "labelNode is for the device plugin (mode: plugin); with mode: dra, the DRA driver publishes each GPU's attributes in its ResourceSlice" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.config .Values.preset -}}
{{- fail "config and preset are two configs: give one of them" -}}
{{- end -}}
{{- if and .Values.config $replicas -}}
{{- fail "replicas applies to the generated config; set the replicas in config instead" -}}
{{- end -}}
{{- include "gpuppetti.layerDir" . -}}
{{- end }}
