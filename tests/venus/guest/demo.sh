#!/bin/sh
# In the venus guest: `gpuppetti demo` on the VM's own GPU, with each pod run as a podman container; beside it,
# `gpuppetti doctor` in a VM whose host-visible window (--hostmem) is smaller than a slice, and wgpu mapping
# buffers until the window is full. Written to $W/out, judged on the host.
#   demo.sh WORK VENV APPS_VENV
set -u
W=$1 VENV=$2 APPS=$3
OUT=$W/out
mkdir -p "$OUT"
export PATH="$VENV/bin:$PATH"
step() { echo "$(date +%s.%N) $*" >> "$OUT/steps.log"; }
step start
# What a node has and this guest lacks: its loopback interface up, a cgroup hierarchy, and container storage on a
# real file system (the guest's root is an overlay, which podman's overlay driver cannot stack on).
busybox ip link set lo up
mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || true
mkdir -p /var/lib/containers && mount -t tmpfs -o size=1G containers /var/lib/containers
export PODMAN_IGNORE_CGROUPSV1_WARNING=1
# The kernel's own words on the window, for the tests to read the way doctor reads the kernel's log.
dmesg | grep -i "memory window" > "$OUT/dmesg-window.txt"
# doctor without debugfs (as on a node that does not mount it): the window from the PCI capabilities.
unshare -m sh -c 'umount /sys/kernel/debug 2>/dev/null; exec "$@"' doctor gpuppetti doctor --config "$W/node.yaml" \
  --mode plugin --json > "$OUT/doctor.json" 2> "$OUT/doctor.err" &
doctor=$!
if command -v podman > /dev/null; then
  COLUMNS=400 gpuppetti demo --config "$W/node.yaml" --runtime podman > "$OUT/demo.txt" 2> "$OUT/demo.err"
else
  echo "podman is not installed in the guest" > "$OUT/no-podman"
  COLUMNS=400 gpuppetti demo --config "$W/node.yaml" > "$OUT/demo.txt" 2> "$OUT/demo.err"
fi
echo $? > "$OUT/demo.rc"; step demo
wait $doctor; echo $? > "$OUT/doctor.rc"; step doctor
"$APPS/bin/python" "$W/wgpu_slice.py" --mapped > "$OUT/mapped.json" 2> "$OUT/mapped.err"
echo $? > "$OUT/mapped.rc"; step mapped
