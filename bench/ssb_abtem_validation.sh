#!/usr/bin/env bash
# SSB physical validation against abTEM multislice (issue 6): simulate SrTiO3 [001] with known
# C10/C12/phi12 at two doses and two thicknesses, write Dectris files, run the
# `ssb_validation` example on each and merge the records into
# bench/results/cpu_ssb_abtem_validation.json.
#   ANCHOR_TOOLS=tests/tools   (simulate_abtem.py, make_dectris.py: the anchor's independent
#                                   tools, given by the developer; the repository never reads them)
#   PY=/tmp/abtem-venv/bin/python  (venv from $ANCHOR_TOOLS/requirements-abtem.lock.txt)
#   WORK=/tmp/ssbval               (scratch)
#   SKIP_SIM=1                     (reuse simulations already in $WORK)
#   CASES="name:cells:dose ..."     (a subset; default the four below)
#   OBJECTIVES=coherence            (default phase_variance,coherence)
#   OUT=bench/results/x.json       (default cpu_ssb_abtem_validation.json)
# The 1-cell coherence subset (the default fit against the all-pixel fit) is
#   CASES="sto_t1_d1e6:1:1e6 sto_t1_d1e5:1:1e5" OBJECTIVES=coherence \
#   OUT=bench/results/cpu_ssb_abtem_coarse_fit.json bash bench/ssb_abtem_validation.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOLS="$(cd "$ROOT" && cd "${ANCHOR_TOOLS:-tests/tools}" && pwd)"
PY="${PY:-/tmp/abtem-venv/bin/python}"
WORK="${WORK:-/tmp/ssbval}"
OUT="${OUT:-$ROOT/bench/results/cpu_ssb_abtem_validation.json}"
mkdir -p "$WORK"
# C10 = +100 A (abTEM defocus -100), C12 = 30 A, phi12 = 0.5 rad; 200 kV, 20 mrad;
# 48x48 scan over 3x3 unit cells -> 0.2441 A step; 64x64 detector at 1.0704 mrad/px.
COMMON="--structure sto --scan 48 --scan-cells 3 --det 64 --defocus -100 --C12 30 --phi12 0.5 --seed 0 --workers 2"
# name  thickness(cells)  dose(e/A^2): 1e6 -> 59,567 e/frame ("high"); 1e5 -> 5,957 e/frame ("realistic")
CASES="${CASES:-sto_d1e6:5:1e6 sto_d1e5:5:1e5 sto_t1_d1e6:1:1e6 sto_t1_d1e5:1:1e5}"
OBJECTIVES="${OBJECTIVES:-phase_variance,coherence}"
cd "$ROOT"
cargo build --release -p qem-bench --example ssb_validation
for c in $CASES; do
  IFS=: read -r name th dose <<<"$c"
  if [ -z "${SKIP_SIM:-}" ] || [ ! -f "$WORK/$name.npz" ]; then
    "$PY" "$TOOLS/simulate_abtem.py" $COMMON --thickness "$th" --dose "$dose" --out "$WORK/$name"
  fi
  "$PY" "$TOOLS/make_dectris.py" --input "$WORK/$name.npz" --out "$WORK/dec_$name/sto" --frames-per-file 1024
  "$PY" -c "import numpy as n; n.load('$WORK/$name.npz')['phase_scan_2alpha'].astype('<f8').tofile('$WORK/truth_$name.f64')"
  # fit ranges: C10 [-400, 400] A, C12 [0, 100] A, phi12 [-pi/2, pi/2]; start 0; seed 0;
  # 200 Halton points + Nelder-Mead (200 iterations) from the 3 best.
  ./target/release/examples/ssb_validation "$WORK/dec_$name/sto_master.h5" "$WORK/$name.json" \
    "$WORK/val_$name.json" --truth "$WORK/truth_$name.f64" --seed 0 --global 200 --local-iter 200 --starts 3 \
    --c10-range -400,400 --c12-range 0,100 --phi12-range -1.5707963267948966,1.5707963267948966 \
    --objectives "$OBJECTIVES"
done
"$PY" - "$WORK" "$OUT" "$COMMON" "$CASES" <<'PYEOF'
import json, sys, os, platform
work, out, common, cases = sys.argv[1:5]
rec = {"what": "SSB (qem::ssb, CPU backend) vs abTEM multislice SrTiO3 [001], issue 6 validation",
       "script": "bench/ssb_abtem_validation.sh", "host": platform.node(), "cpus": os.cpu_count(),
       "abtem_common_args": common, "cases": {}}
for c in cases.split():
    name, th, dose = c.split(":")
    v = json.load(open(f"{work}/val_{name}.json"))
    sim = json.load(open(f"{work}/{name}.json"))
    v["abtem_command"] = f"simulate_abtem.py {common} --thickness {th} --dose {dose} --out {name}"
    v["thickness_cells"] = int(th); v["thickness_A"] = int(th) * 3.905
    v["simulation_timings_s"] = sim["timings_s"]; v["abtem_version"] = sim["abtem_version"]
    rec["cases"][name] = v
json.dump(rec, open(out, "w"), indent=1)
print("wrote", out)
PYEOF
