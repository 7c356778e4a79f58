{{- /* Rendered by tools/gen_chart.py from gpuppetti.commands.manifests (`make deploy`). Edit the generator, not this. */ -}}

{{/* The node label that says which mode a node runs, and this mode's value of it. */}}
{{- define "gpuppetti.modeLabel" -}}gpuppetti.dev/mode{{- end }}
{{- define "gpuppetti.modeLabelValue" -}}{{ get (dict "deviceplugin" "plugin" "dra" "dra") .Values.mode }}{{- end }}

{{/* This mode's DaemonSet. */}}
{{- define "gpuppetti.daemonSet" -}}{{ get (dict "deviceplugin" "gpuppetti-device-plugin" "dra" "gpuppetti-dra") .Values.mode }}{{- end }}

{{/* The config when none is given: time-sliced replicas of every GPU with replicas above 1. */}}
{{- define "gpuppetti.defaultConfig" -}}
version: v1
{{- if gt (int (.Values.replicas | default 0)) 1 }}
sharing:
  timeSlicing:
    resources:
      - name: apple.com/gpu
        replicas: {{ .Values.replicas }}
      - name: nvidia.com/gpu
        replicas: {{ .Values.replicas }}
      - name: amd.com/gpu
        replicas: {{ .Values.replicas }}
      - name: gpu.intel.com/i915
        replicas: {{ .Values.replicas }}
      - name: gpuppetti.dev/gpu
        replicas: {{ .Values.replicas }}
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
