#!/usr/bin/env bash
# Run 19: dpc.run's host stages (CoM, rotation, sign; rayon) took 2–8× longer in run 18 than in
# run 17 on the same code. With com_from_moments and the sign statistics in two regions each (were
# six and four), the façade bench with RAYON_NUM_THREADS = 16 (default), 4 and 1,
# and the host's load before each. Builds nothing; carried: device_carry/.
source "$(dirname "$0")/device_lib.sh"
nproc > "$R/host.txt"; cat /proc/cpuinfo | grep "model name" | head -1 >> "$R/host.txt"
make_reference
for t in 16 4 1; do
  [ $SECONDS -ge 400 ] && break
  echo "threads $t loadavg $(cat /proc/loadavg)" | tee -a "$R/host.txt"
  RAYON_NUM_THREADS=$t timeout 100 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_t$t.json" 10 > "$R/facade_t$t.log" 2>&1; echo "t=$t rc=$?"
  grep -E "^dense " "$R/facade_t$t.log" | sed 's/integrate.*//'; pack
done
