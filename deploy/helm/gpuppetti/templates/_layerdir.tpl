{{/* Rendered by tools/gen_chart.py (`make deploy`). Edit the generator, not this. From gpuppetti.base.nodepaths. */}}
{{- define "gpuppetti.layerDir" -}}
{{- with .Values.vulkanLayerDir -}}
{{- $path := clean . -}}
{{- if eq $path "/host" -}}
{{- fail (printf "vulkanLayerDir: %s is where the DaemonSets mount the node's root: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix "/host/" $path -}}
{{- fail (printf "vulkanLayerDir: %s is inside /host, where the DaemonSets mount the node's root: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix (printf "%s/" (trimSuffix "/" $path)) "/host" -}}
{{- fail (printf "vulkanLayerDir: %s holds /host, where the DaemonSets mount the node's root: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if eq $path "/etc/gpuppetti" -}}
{{- fail (printf "vulkanLayerDir: %s is where the DaemonSets mount the config: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix "/etc/gpuppetti/" $path -}}
{{- fail (printf "vulkanLayerDir: %s is inside /etc/gpuppetti, where the DaemonSets mount the config: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix (printf "%s/" (trimSuffix "/" $path)) "/etc/gpuppetti" -}}
{{- fail (printf "vulkanLayerDir: %s holds /etc/gpuppetti, where the DaemonSets mount the config: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if eq $path "/var/lib/kubelet/device-plugins" -}}
{{- fail (printf "vulkanLayerDir: %s is where the DaemonSets mount the kubelet's device plugin directory: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix "/var/lib/kubelet/device-plugins/" $path -}}
{{- fail (printf "vulkanLayerDir: %s is inside /var/lib/kubelet/device-plugins, where the DaemonSets mount the kubelet's device plugin directory: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix (printf "%s/" (trimSuffix "/" $path)) "/var/lib/kubelet/device-plugins" -}}
{{- fail (printf "vulkanLayerDir: %s holds /var/lib/kubelet/device-plugins, where the DaemonSets mount the kubelet's device plugin directory: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if eq $path "/var/run/cdi" -}}
{{- fail (printf "vulkanLayerDir: %s is where the DaemonSets mount the CDI specs: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix "/var/run/cdi/" $path -}}
{{- fail (printf "vulkanLayerDir: %s is inside /var/run/cdi, where the DaemonSets mount the CDI specs: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix (printf "%s/" (trimSuffix "/" $path)) "/var/run/cdi" -}}
{{- fail (printf "vulkanLayerDir: %s holds /var/run/cdi, where the DaemonSets mount the CDI specs: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if eq $path "/var/run/secrets/gpuppetti-host-agent" -}}
{{- fail (printf "vulkanLayerDir: %s is where the DaemonSets mount the host agent's token: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix "/var/run/secrets/gpuppetti-host-agent/" $path -}}
{{- fail (printf "vulkanLayerDir: %s is inside /var/run/secrets/gpuppetti-host-agent, where the DaemonSets mount the host agent's token: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix (printf "%s/" (trimSuffix "/" $path)) "/var/run/secrets/gpuppetti-host-agent" -}}
{{- fail (printf "vulkanLayerDir: %s holds /var/run/secrets/gpuppetti-host-agent, where the DaemonSets mount the host agent's token: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if eq $path "/var/lib/kubelet/plugins_registry" -}}
{{- fail (printf "vulkanLayerDir: %s is where the DaemonSets mount the kubelet's plugin registry: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix "/var/lib/kubelet/plugins_registry/" $path -}}
{{- fail (printf "vulkanLayerDir: %s is inside /var/lib/kubelet/plugins_registry, where the DaemonSets mount the kubelet's plugin registry: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix (printf "%s/" (trimSuffix "/" $path)) "/var/lib/kubelet/plugins_registry" -}}
{{- fail (printf "vulkanLayerDir: %s holds /var/lib/kubelet/plugins_registry, where the DaemonSets mount the kubelet's plugin registry: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if eq $path "/var/lib/kubelet/plugins" -}}
{{- fail (printf "vulkanLayerDir: %s is where the DaemonSets mount the kubelet's plugin directory: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix "/var/lib/kubelet/plugins/" $path -}}
{{- fail (printf "vulkanLayerDir: %s is inside /var/lib/kubelet/plugins, where the DaemonSets mount the kubelet's plugin directory: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- else if hasPrefix (printf "%s/" (trimSuffix "/" $path)) "/var/lib/kubelet/plugins" -}}
{{- fail (printf "vulkanLayerDir: %s holds /var/lib/kubelet/plugins, where the DaemonSets mount the kubelet's plugin directory: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if has $path (list "/" "/var" "/var/lib" "/var/lib/kubelet" "/var/run" "/run" "/tmp" "/var/tmp" "/home" "/root" "/opt" "/srv" "/mnt" "/media") -}}
{{- fail (printf "vulkanLayerDir: %s is a system directory: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/proc") (hasPrefix "/proc/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /proc, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/sys") (hasPrefix "/sys/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /sys, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/dev") (hasPrefix "/dev/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /dev, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/etc") (hasPrefix "/etc/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /etc, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/usr") (hasPrefix "/usr/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /usr, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/bin") (hasPrefix "/bin/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /bin, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/sbin") (hasPrefix "/sbin/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /sbin, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/lib") (hasPrefix "/lib/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /lib, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/lib32") (hasPrefix "/lib32/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /lib32, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/lib64") (hasPrefix "/lib64/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /lib64, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/libx32") (hasPrefix "/libx32/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /libx32, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- if or (eq $path "/boot") (hasPrefix "/boot/" $path) -}}
{{- fail (printf "vulkanLayerDir: %s is in /boot, the system's own: give a directory of its own, such as /var/lib/gpuppetti/vulkan, or '' to turn enforcement off" $path) -}}
{{- end -}}
{{- end -}}
{{- end }}
