#!/usr/bin/env bash
# Issue 20: detector calibration and focal reference against abTEM multislice, one command.
#   bench/calibration_validation.sh
# 1. simulates SrTiO3 [001] with abTEM (noise-free intensities; tests/tools/simulate_abtem.py):
#    calibration cases over 80-300 kV, 15-35 mrad, 1-5 cells (16x16 scans), and focal-reference
#    cases (1, 3, 5 cells at 200 and 300 kV, 32x32 scans, known defocus);
# 2. runs bench/calibration_validation.py with the installed quantem.gpu: Poisson counts at
#    1e3 and 1e6 e-/frame, the detector binned 1-3x by io.load(det_bin=), optionally blurred,
#    SSB's default sampling (alpha / r_edge) vs the true mrad/px; then C10 with the true
#    sampling; writes bench/results/cpu_calibration_validation.json.
# Env: PY (abTEM venv python, default /tmp/abtem-venv-E/bin/python), OURS (python with
# quantem.gpu, default python3), WORK (scratch, default /tmp/calval), SKIP_SIM=1 (reuse .npz).
# Variants (tests/tools/simulate_abtem_variant.py): hard_* = hard aperture, foc_*_weak = potential x0.1.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-/tmp/abtem-venv-E/bin/python}"
OURS="${OURS:-python3}"
WORK="${WORK:-/tmp/calval}"
OUT="${OUT:-$ROOT/bench/results/cpu_calibration_validation.json}"
mkdir -p "$WORK"
SIM="$ROOT/tests/tools/simulate_abtem.py"
# name : kV : mrad : cells : reps (lateral tiles; sets the angular sampling) : gpts : det px : scan : scan cells : abTEM defocus (A)
CASES="
cal_80kv_15mrad_1c:80:15:1:17:512:72:16:1:0
cal_80kv_35mrad_3c:80:35:3:6:256:48:16:1:0
cal_200kv_25mrad_3c:200:25:3:6:256:72:16:1:0
cal_200kv_20mrad_5c:200:20:5:6:256:60:16:1:0
cal_300kv_15mrad_1c:300:15:1:8:320:72:16:1:0
cal_300kv_35mrad_5c:300:35:5:6:256:108:16:1:0
foc_200kv_1c:200:25:1:6:256:64:32:2:-100
foc_200kv_3c:200:25:3:6:256:64:32:2:-100
foc_200kv_5c:200:25:5:6:256:64:32:2:-100
foc_300kv_1c:300:20:1:6:256:64:32:2:80
foc_300kv_3c:300:20:3:6:256:64:32:2:80
foc_300kv_5c:300:20:5:6:256:64:32:2:80
"
sim() {  # out-name, then the fields of one case (the wrapper first for a hard aperture)
  local out="$1" kv="$2" mrad="$3" cells="$4" reps="$5" gpts="$6" det="$7" scan="$8" scells="$9" df="${10}"
  shift 10
  if [ -n "${SKIP_SIM:-}" ] && [ -f "$WORK/$out.npz" ]; then return; fi
  nice -n 5 "$PY" "$@" "$SIM" --structure sto --energy "${kv}e3" --semiangle "$mrad" --thickness "$cells" \
    --reps "$reps" --gpts "$gpts" --det "$det" --scan "$scan" --scan-cells "$scells" \
    --defocus "$df" --dose 0 --seed 0 --workers 2 --out "$WORK/$out"
}
for c in $CASES; do
  IFS=: read -r name kv mrad cells reps gpts det scan scells df <<<"$c"
  sim "$name" "$kv" "$mrad" "$cells" "$reps" "$gpts" "$det" "$scan" "$scells" "$df"
  # the calibration cases again with a hard aperture (abTEM's default tapers the amplitude)
  case "$name" in cal_*)
    sim "hard_${name#cal_}" "$kv" "$mrad" "$cells" "$reps" "$gpts" "$det" "$scan" "$scells" "$df" \
      "$ROOT/tests/tools/simulate_abtem_variant.py" --hard-aperture;;
  esac
  # the focal cases at 200 kV again with the potential x0.1 (kinematic control)
  case "$name" in foc_200kv_*)
    sim "${name}_weak" "$kv" "$mrad" "$cells" "$reps" "$gpts" "$det" "$scan" "$scells" "$df" \
      "$ROOT/tests/tools/simulate_abtem_variant.py" --potential-scale 0.1;;
  esac
done
"$OURS" "$ROOT/bench/calibration_validation.py" --work "$WORK" --out "$OUT"
