#!/bin/sh
# In the venus guest: a node's day, through gpuppetti's commands. Written to $W/out, judged on the host.
#   node.sh WORK VENV APPS_VENV
# The device plugin serves the virtio-gpu (drm backend) to the kubelet emulator of driver.py, which admits pods and
# runs workloads in their containers; meanwhile `gpuppetti discover` (with the Apple-silicon guide's virtio config)
# and, once the plugin has registered, `gpuppetti doctor` against that plugin and its kubelet directory. Once the
# timed workloads are done, `gpuppetti dra` on the same GPU, in the cluster of dra.py (the tests' API server and DRA
# kubelet stand-ins, which prepare the claims it allocates and run their containers), beside driver.py's last one.
set -u
W=$1 VENV=$2 APPS=$3
OUT=$W/out
mkdir -p "$OUT" "$W/dp"
export PATH="$VENV/bin:$PATH" COLUMNS=200
step() { echo "$(date +%s.%N) $*" >> "$OUT/steps.log"; }
step start
uname -m > "$OUT/uname"
# What a node has and this guest lacks: its loopback interface up (the daemons' HTTP endpoint is on 127.0.0.1).
busybox ip link set lo up
gpuppetti plugin --config "$W/node.yaml" --device-plugin-dir "$W/dp" --vulkan-layer-dir /var/lib/gpuppetti/vulkan \
  --http-address 127.0.0.1:9400 --log-level debug > "$OUT/plugin.log" 2>&1 &
plugin=$!
"$VENV/bin/python" "$W/driver.py" "$W" "$OUT" "$APPS/bin/python" > "$OUT/driver.log" 2>&1 &
driver=$!
gpuppetti discover --config "$W/guide.yaml" --json > "$OUT/discover.json" 2> "$OUT/discover.err"
echo $? > "$OUT/discover.rc"; step discover
waited=0
while [ ! -e "$OUT/registered" ] && [ $waited -lt 300 ] && kill -0 $driver 2>/dev/null; do sleep 1; waited=$((waited + 1)); done
step registered
gpuppetti doctor --config "$W/node.yaml" --mode plugin --device-plugin-dir "$W/dp" --cdi-dir "$W/cdi" \
  --vulkan-layer-dir /var/lib/gpuppetti/vulkan --daemon http://127.0.0.1:9400 --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
echo $? > "$OUT/doctor.rc"; step doctor
touch "$OUT/quiet"
# The emulated CPUs are the guest's scarcest resource: the DRA scenario takes them only once the timed workloads
# are done, while the last workload (one process) leaves one free.
waited=0
while [ ! -e "$OUT/timed" ] && [ $waited -lt 600 ] && kill -0 $driver 2>/dev/null; do sleep 1; waited=$((waited + 1)); done
step timed
"$VENV/bin/python" "$W/dra.py" "$W" "$OUT" > "$OUT/dra-runner.log" 2>&1 &
dra=$!
wait $driver; echo $? > "$OUT/driver.rc"; step driver
wait $dra; echo $? > "$OUT/dra-runner.rc"; step dra
kill -TERM $plugin; wait $plugin; echo $? > "$OUT/plugin.rc"; step plugin-stopped
