#!/usr/bin/env bash
# The one device script: runs on the GPU machine from the repository root, with device_carry/
# carried (made here by bench/prepare_carry.sh; it builds nothing). The qem-cuda-*-check
# binaries and the cuda_products_bench / ssb_cuda_bench programs are crates/qem-bench's. Usage:
#
#   bench/device.sh MODE [MODE ...]
#
#   checks    qem-cuda-check on the bslz4 vectors, malformed and mutated chunks (GPU = CPU verdicts);
#             the synthetic qem-cuda-products-check and qem-cuda-rans-check cases; the Rust ssb
#             tests (CPU reference vs CUDA); device_result (results kept on the card = host ones);
#             every_engine (each engine-level case on the CPU and CUDA arms); the GPU-facing
#             pytest files (PYTEST_FILES, or "all")
#   load      the 512² × 192² reference acquisition: qem-cuda-load-check (dense, every frame =
#             CPU), qem-cuda-rans-check (ENCODED load, every frame hash = CPU, .qem round trip),
#             `qem-bench load --backend cuda --cpu-check` (the façade), read_probe (the host's
#             routes to the card: pread into pinned slots, the H2D floor, registered read-only
#             file mappings, O_DIRECT); CUPY=1 adds a run with --cupy (h5py + hdf5plugin +
#             cupy.asarray, ~2 min)
#   products  qem-cuda-products-check on the reference (ENCODED and dense, GPU = CPU), the
#             façade bench (cuda_products_bench: products, dpc.run), CuPy on the same dense array
#             (bench/cupy_products.py), pair_probe (a two-pixel-symbol decode, study)
#   ssb       ssb_cuda_bench on the reference (r = 30 px, with a 6 GiB card budget and a CPU check
#             of a 64² region), on r = 53 px (resident ENCODED, then host-held data under 6 GiB),
#             and `quantem-gpu ssb --fit`
#   sanitize  compute-sanitizer memcheck over qem-cuda-check --sanitize-subset, the synthetic
#             products check and qem-cuda-load-check (full and region + bin) on a 32² acquisition;
#             memcheck and racecheck over device_result's DPC-on-the-card tests; memcheck over
#             the encoded load's sum DP (device_result) and the SSB test of a tight budget (f12
#             G, staged ENCODED gather)
#   profile   Nsight Compute: the dense and ENCODED product kernels, the SSB accumulate kernel,
#             the rANS frame sums, the rANS encode of the encoded load (with its per-line
#             source counters), the bitshuffle/LZ4 decode with the payload parsed from global
#             and from shared memory (per-line source counters); PROFILE="name ..." runs only
#             those of products, ssb, rans, encode, bslz4
#   soak      the reliability campaign (tests/gpu/soak.py; the CPU engine is the reference): the
#             issue-17 repro, an injected device loss, a 500-operation seeded soak over ENCODED,
#             DENSE and CPU datasets, 200 load/close cycles, 4 threads, and the soak under
#             compute-sanitizer memcheck, racecheck and synccheck → CARD_reliability.json
#   serve     the browse service's latency on the reference (serve-latency: the server in-process,
#             HTTP over loopback, ENCODED resident): virtual images, frames, binned frames, a
#             scan-ROI DP and a 20-per-second drag → CARD_serve_latency.json
#   startup   first-use costs through the Python API, each in a fresh process (bench/startup.py):
#             import, first io.load, first detector.products and dpc.run, with NVRTC and an
#             empty kernel cache, the cache warm, then with the shipped kernels → CARD_startup.json
#   distributed  Dask workers sharing the card (tests/gpu/distributed_check.py, 128² × 192²):
#             device indices, distributed products and DPC = the single-process CUDA engine,
#             1 vs 2 workers timed (Dask installed from the carried wheels) → distributed_check.json
#   lz4       the LZ4 payload staged in shared memory (LaunchShape::stage_payload) against the
#             parse from global memory: qem-cuda-check (every verdict case decoded both ways,
#             the generated acquisitions timed both ways); the encoded load of the reference
#             in two rounds of: the base build (device_carry/base/, when carried), --lz4-stage
#             off, on, and on with --overlap on (decode beside encode), every frame = CPU each
#             time, p50 and stages; the dense load once per build and parse; then racecheck
#             and memcheck over qem-cuda-check's sanitize subset
#   all       checks load products ssb sanitize soak (longer than one 10-minute call: the steps
#             past STEP_BUDGET are skipped and say so)
#
# Environment: OUT (default /tmp/out): everything goes under it — raw outputs and logs in
# $OUT/res, the records under the names bench/results/ uses in $OUT/records (prefixed with
# the card: h100_, h200_) — and all of it is
# packed into $OUT/results.tgz (rewritten after every step, so a run cut short still returns
# what it did). STEP_BUDGET (seconds, default 560): later steps are skipped. QEM_GIT_REVISION
# (default: device_carry/REVISION, written by prepare_carry.sh) names the code in the records.
# Exit status: the OR of the steps' statuses (2 on bad usage or a missing carry).
set -uo pipefail
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
D=$PWD/device_carry
# A carry packed by prepare_carry.sh (PACK=1: device_carry_xz/carry.tar.xz, for carries over the
# tool's 64 MiB) is unpacked first.
if [ ! -d "$D" ] && [ -f device_carry_xz/carry.tar.xz ]; then tar xJf device_carry_xz/carry.tar.xz; fi
[ -x "$D/qem-cuda-products-check" ] || { echo "no device_carry/ here: run bench/prepare_carry.sh and carry it" >&2; exit 2; }
OUT=${OUT:-/tmp/out}; R=$OUT/res; REC=$OUT/records; mkdir -p "$R" "$REC"
export PYTHONPATH=$D/site:$D/h5p PATH=$D/site/bin:$PATH
export QEM_GIT_REVISION=${QEM_GIT_REVISION:-$(cat "$D/REVISION" 2>/dev/null || echo unknown)}
STEP_BUDGET=${STEP_BUDGET:-560}
# Records are named after the card that made them (h100_…, h200_…): the tool lends either.
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'H100|H200|A100|L40S?' | head -1 | tr 'A-Z' 'a-z')
CARD=${CARD:-gpu}
GIB6=6442450944
REF=/tmp/ref/scan_master.h5
rc=0

pack() { ( cd "$OUT" && tar czf results.tgz.part --exclude='results.tgz*' . && mv results.tgz.part results.tgz ); }
step() { # NAME LOG CMD...: CMD's output into $R/LOG, its status ORed into rc
  local name=$1 log=$2; shift 2
  if [ "$SECONDS" -ge "$STEP_BUDGET" ]; then echo "$name: skipped (STEP_BUDGET ${STEP_BUDGET}s)"; return; fi
  "$@" > "$R/$log" 2>&1; local r=$?; rc=$((rc | r)); echo "$name: rc=$r (${SECONDS}s)"; pack
}
record() { # SRC NAME: a record under the stable name bench/results/ gives it, CARD_NAME
  local src
  for src in $1; do [ -f "$src" ] && cp "$src" "$REC/${CARD}_$2" && return; done
  echo "record ${CARD}_$2: no $1"
}
tool() { # the first of NAME and /usr/local/cuda*/bin/NAME
  command -v "$1" || ls /usr/local/cuda*/bin/"$1" 2>/dev/null | head -1
}
acquisition() { # DIR [VAR=VALUE ...]: the anchor's reference generator, once per machine
  local dir=$1; shift
  if [ ! -f "$dir/scan_master.h5" ]; then
    step "generate $dir" "generate_$(basename "$dir").log" env "$@" python3 "$D/make_reference_acquisition.py" "$dir"
  fi
  cat "$dir"/*.h5 > /dev/null 2>&1 # warm page cache: the load figures are warm-cache figures
}

mode_checks() {
  step "bslz4 kernel check" bslz4_check.log timeout 120 "$D/qem-cuda-check" --vectors "$D/vectors" --out "$R/bslz4"
  record "$R/bslz4/cuda_bslz4_check.json" bslz4_check.json
  step "products check (synthetic)" products_synth.log timeout 120 "$D/qem-cuda-products-check" --out "$R/products_synth"
  step "rans check (synthetic)" rans_synth.log timeout 120 "$D/qem-cuda-rans-check" --out "$R/rans_synth"
  step "rust ssb tests" ssb_tests.log timeout 150 "$D/ssb_tests" --nocapture --test-threads 1
  step "every engine (CPU and CUDA arms)" every_engine.log timeout 120 "$D/every_engine_tests" --nocapture
  tail -3 "$R/every_engine.log"
  step "device results (CUDA = host, kept arrays)" device_result.log timeout 120 "$D/device_result_tests" --nocapture
  tail -3 "$R/device_result.log"
  record "$R/ssb_tests.log" ssb_tests.txt
  with_dask # the lazy and distributed tests skip without it
  local files=${PYTEST_FILES:-test_cuda.py test_products.py test_dpc.py test_ssb.py test_encoded.py}
  [ "$files" = all ] && files=.
  step "pytest ($files)" pytest_gpu.log bash -c "cd tests/python && timeout 300 python3 -m pytest -q -p no:cacheprovider -rs $files"
  tail -2 "$R/pytest_gpu.log"
}

mode_load() {
  acquisition /tmp/ref
  step "dense load check" load_dense.log timeout 150 "$D/qem-cuda-load-check" --load "$REF" --repeats 5 --out "$R/load_dense"
  step "encoded load (rans check)" load_encoded.log timeout 150 "$D/qem-cuda-rans-check" --load "$REF" --repeats 5 --qem /tmp/ref.qem --out "$R/load_encoded"
  rm -f /tmp/ref.qem
  record "$R/load_encoded/rans_check.json" load_encoded.json
  step "facade bench load" load_facade.log timeout 150 "$D/qem-bench" load --backend cuda --source "$REF" --repeats 7 --cpu-check --out "$R/load_facade"
  record "$R/load_facade/cuda_load_*.json" load_encoded_facade.json
  if [ "${CUPY:-0}" = 1 ]; then
    step "facade bench load + h5py/CuPy" load_cupy.log timeout 300 "$D/qem-bench" load --backend cuda --source "$REF" --repeats 5 --warmup 1 --cpu-check --cupy --out "$R/load_cupy"
  fi
  grep -hE "p50|PASS|FAIL|mismatch" "$R"/load_*.log | head -20
  # Issue 23 item 3: the host's routes to the card (pread into pinned slots by 8/16/32 threads,
  # the H2D floor, read-only file mappings registered and copied from the page cache, O_DIRECT).
  step "read routes probe" read_probe.log timeout 200 "$D/read_probe" "$R/read_probe.json" /tmp/ref/scan_data_*.h5 --threads 8,16,32 --repeats 3
  record "$R/read_probe.json" read_probe.json
  cat "$R/read_probe.log"
}

mode_lz4() { # the staged LZ4 parse (bslz4_decode.cu decode_block) against the global one
  step "bslz4 check, both payload paths" bslz4_check.log timeout 150 "$D/qem-cuda-check" --vectors "$D/vectors" --out "$R/bslz4" --frames 8192 --warps 1,2 --reps 10
  record "$R/bslz4/cuda_bslz4_check.json" bslz4_check.json
  grep -E "FAIL|payload|w[12] " "$R/bslz4_check.log" | tail -24
  acquisition /tmp/ref
  # Variants: base (the build of device_carry/base/, prepare_carry.sh BASE_REV=…, when
  # carried), global and staged LZ4 parse, staged with decode beside encode (two compute
  # streams). Ordered so that a short STEP_BUDGET still gets one of each: round 1, the dense
  # loads (once per build and parse: they do not encode), racecheck, round 2, memcheck.
  local round="global staged overlap" san; san=$(tool compute-sanitizer)
  [ -x "$D/base/qem-cuda-rans-check" ] && round="base $round"
  lz4_encoded 1 $round
  local v
  for v in $round; do
    [ "$v" = overlap ] || lz4_load "$v" dense
  done
  [ -n "$san" ] && step "racecheck bslz4 (both paths)" racecheck_bslz4.log timeout 150 "$san" --tool racecheck --error-exitcode 9 "$D/qem-cuda-check" --vectors "$D/vectors" --sanitize-subset --out "$R/racecheck_bslz4"
  lz4_encoded 2 $round
  [ -n "$san" ] && step "memcheck bslz4 (both paths)" memcheck_bslz4.log timeout 150 "$san" --tool memcheck --leak-check no --error-exitcode 9 "$D/qem-cuda-check" --vectors "$D/vectors" --sanitize-subset --out "$R/memcheck_bslz4"
  grep -H "ERROR SUMMARY\|RACECHECK SUMMARY" "$R"/racecheck_bslz4.log "$R"/memcheck_bslz4.log 2>/dev/null
  rm -f /tmp/ref.qem
}

lz4_encoded() { # ROUND VARIANT...: the encoded load of each variant
  local r=$1 v; shift
  for v in "$@"; do lz4_load "$v" encoded "$r"; done
}

lz4_load() { # VARIANT encoded|dense [ROUND]: one load check of the reference (mode lz4)
  local v=$1 kind=$2 tag=${1}_${3:-1} args=() dir=$D
  case $v in
    base) dir=$D/base ;;
    global) args=(--lz4-stage off) ;;
    staged) args=(--lz4-stage on) ;;
    overlap) args=(--lz4-stage on --overlap on) ;;
  esac
  if [ "$kind" = encoded ]; then
    step "encoded load, $v" "load_encoded_$tag.log" timeout 120 "$dir/qem-cuda-rans-check" --load "$REF" --repeats 5 --qem /tmp/ref.qem "${args[@]}" --out "$R/load_encoded_$tag"
    grep -hE "p50|mismatch|FAIL|^ +(read\+table|decode \(ev|encode \(ev|gpu load|plan \(host)" "$R/load_encoded_$tag.log" | head -10
  else
    step "dense load, $v" "load_dense_$tag.log" timeout 120 "$dir/qem-cuda-load-check" --load "$REF" --repeats 5 "${args[@]}" --out "$R/load_dense_$tag"
    grep -hE "p50|FAIL|^ +(read\+table|decode \(ev)" "$R/load_dense_$tag.log" | head -6
  fi
}

mode_products() {
  acquisition /tmp/ref
  step "products check" products_check.log timeout 150 "$D/qem-cuda-products-check" --load "$REF" --repeats 10 --out "$R/products"
  record "$R/products/products_check.json" products.json
  grep -E "^(encoded|dense) |ALL|FAIL" "$R/products_check.log" | head -16
  step "facade products bench" facade_products.log timeout 150 "$D/cuda_products_bench" "$REF" "$R/facade_products.json" 10
  record "$R/facade_products.json" products_facade.json
  step "cupy products" cupy_products.log timeout 120 python3 bench/cupy_products.py "$REF" "$R/cupy_products.json" 10
  record "$R/cupy_products.json" products_cupy.json
  # Issue 23 item 2: a two-pixel-symbol decode measured before any format version (a study: its
  # JSON stays in $R; docs/history.md quotes it).
  step "pair symbol probe" pair_probe.log timeout 240 "$D/pair_probe" "$R/pair_probe.json" --frames 32768 --d 10,12,14,16 --repeats 10
  cat "$R/pair_probe.log"
}

mode_ssb() {
  acquisition /tmp/ref
  acquisition /tmp/ref53 RADIUS=53 # 8,653 BF pixels
  step "ssb r30" ssb_r30.log timeout 200 "$D/ssb_cuda_bench" "$REF" "$R/ssb_r30.json" r30 --card-budget $GIB6 --cpu-check 64 --fit-pv
  record "$R/ssb_r30.json" ssb_r30.json
  step "ssb r53" ssb_r53.log timeout 200 "$D/ssb_cuda_bench" /tmp/ref53/scan_master.h5 "$R/ssb_r53.json" r53 --card-budget $GIB6 --fit-pv --storages
  record "$R/ssb_r53.json" ssb_r53.json
  step "ssb r53 host data" ssb_r53_host.log timeout 240 "$D/ssb_cuda_bench" /tmp/ref53/scan_master.h5 "$R/ssb_r53_host.json" r53_host --host-data --card-budget $GIB6
  record "$R/ssb_r53_host.json" ssb_r53_host.json
  step "cli ssb --fit" cli_ssb.log timeout 120 quantem-gpu ssb "$REF" --voltage-kv 300 --semiangle-mrad 25 --scan-step-a 0.4 --fit --objective coherence --out "$R/cli_ssb"
  rm -f "$R"/cli_ssb/*.npy
}

mode_sanitize() {
  local san; san=$(tool compute-sanitizer)
  [ -n "$san" ] || { echo "sanitize: no compute-sanitizer"; rc=$((rc | 1)); return; }
  acquisition /tmp/small SCAN=32
  local m=("$san" --tool memcheck --leak-check no --error-exitcode 9)
  step "memcheck bslz4 check" memcheck_bslz4.log timeout 300 "${m[@]}" "$D/qem-cuda-check" --vectors "$D/vectors" --sanitize-subset --out "$R/memcheck_bslz4"
  step "memcheck products check" memcheck_products.log timeout 300 "${m[@]}" "$D/qem-cuda-products-check" --out "$R/memcheck_products"
  step "memcheck load check" memcheck_load.log timeout 200 "${m[@]}" "$D/qem-cuda-load-check" --load /tmp/small/scan_master.h5 --repeats 1 --out "$R/memcheck_load"
  step "memcheck load check, region + bin" memcheck_load_region.log timeout 200 "${m[@]}" "$D/qem-cuda-load-check" --load /tmp/small/scan_master.h5 --region 3 29 5 27 --bin 2 --repeats 1 --out "$R/memcheck_load_region"
  # the DPC stages on the card (kernels/dpc.cu, device_forms.cu) and the encoded load's sum DP
  # (region_bin.cu): memcheck, and racecheck for the ordered sums staged in shared memory
  local t=(dpc_run com_on_the_device --test-threads 1)
  step "memcheck dpc on the card, load sum DP" memcheck_dpc.log timeout 300 "${m[@]}" "$D/device_result_tests" "${t[@]}" encoded_file_load
  step "racecheck dpc on the card" racecheck_dpc.log timeout 300 "$san" --tool racecheck --error-exitcode 9 "$D/device_result_tests" "${t[@]}"
  # SSB's f12 G and the staged ENCODED gather (kernels/ssb.cu) under a tight budget
  step "memcheck ssb staged gather, f12" memcheck_ssb.log timeout 300 "${m[@]}" "$D/ssb_tests" cuda_tight --test-threads 1
  grep -H "ERROR SUMMARY" "$R"/memcheck_*.log "$R"/racecheck_*.log
}

mode_profile() {
  local ncu; ncu=$(tool ncu)
  [ -n "$ncu" ] || { echo "profile: no ncu"; rc=$((rc | 1)); return; }
  acquisition /tmp/ref
  local s="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats"
  local only=" ${PROFILE:-products ssb rans encode bslz4} "
  if [[ $only == *" products "* ]]; then
    step "ncu dense products" ncu_products_dense.txt timeout 120 "$ncu" -k regex:qem_products_dense_u16 -c 12 $s "$D/cuda_products_bench" "$REF" /tmp/ncu_products.json 1
    record "$R/ncu_products_dense.txt" ncu_products_dense.txt
    step "ncu encoded products" ncu_products_encoded.txt timeout 120 "$ncu" -k regex:qem_products_encoded -c 4 $s "$D/cuda_products_bench" "$REF" /tmp/ncu_products.json 1
  fi
  if [[ $only == *" ssb "* ]]; then
    step "ncu ssb accumulate" ncu_ssb.txt timeout 150 "$ncu" -k regex:qem_ssb_accumulate_quad_g32 -c 1 $s "$D/ssb_cuda_bench" "$REF" /tmp/ncu_ssb.json prof --repeats 1
  fi
  if [[ $only == *" rans "* ]]; then
    step "ncu rans frame sums" ncu_rans.txt timeout 150 "$ncu" -k regex:qem_rans_frame_sums -c 2 $s "$D/qem-cuda-rans-check" --frames 256 --load "$REF" --repeats 1 --qem /tmp/ncu.qem --out "$R/ncu_rans"
  fi
  if [[ $only == *" encode "* ]]; then
    # The encoded load's main-pass encode (launches 21 and 22: the synthetic cases and the
    # sample's count-only encode come first), then its stall samples per SASS line.
    step "ncu rans encode" ncu_encode.txt timeout 200 "$ncu" -k regex:qem_rans_encode -s 20 -c 2 $s --section SourceCounters --section WarpStateStats -o "$R/ncu_encode" -f "$D/qem-cuda-rans-check" --frames 256 --load "$REF" --repeats 1 --qem /tmp/ncu.qem --out "$R/ncu_encode_check"
    step "ncu rans encode, per line" ncu_encode_source.csv "$ncu" -i "$R/ncu_encode.ncu-rep" --page source --csv --print-source sass
    "$ncu" -i "$R/ncu_encode.ncu-rep" --page details > "$R/ncu_encode_details.txt" 2>&1
  fi
  if [[ $only == *" bslz4 "* ]]; then
    # The dense load's bitshuffle/LZ4 decode (the encoded load's 66 ms of decode is the same
    # kernel), global and staged payload parse, then the staged one's stall samples per line.
    local v
    for v in off on; do
      step "ncu bslz4 decode, lz4 stage $v" "ncu_bslz4_$v.txt" timeout 200 "$ncu" -k regex:qem_bslz4_decode_u16 -s 4 -c 2 $s --section SourceCounters -o "$R/ncu_bslz4_$v" -f "$D/qem-cuda-load-check" --load "$REF" --repeats 1 --lz4-stage $v --out "$R/ncu_bslz4_check_$v"
      step "ncu bslz4 decode $v, per line" "ncu_bslz4_source_$v.csv" "$ncu" -i "$R/ncu_bslz4_$v.ncu-rep" --page source --csv --print-source sass
    done
  fi
  rm -f /tmp/ncu.qem
}

mode_soak() { # the reliability campaign (issue 17): tests/gpu/soak.py, GPU against the CPU engine
  acquisition /tmp/ref
  acquisition /tmp/ref256 SCAN=256
  acquisition /tmp/ref128 SCAN=128
  acquisition /tmp/small SCAN=32
  local S=tests/gpu/soak.py san; san=$(tool compute-sanitizer)
  step "u32 sources" soak_u32.log python3 -c "import sys; sys.path.insert(0, 'tests/gpu'); from pathlib import Path; import soak
soak.write_u32_source(Path('/tmp/u32.h5'), scan=(48, 40), det=(96, 80)); soak.write_u32_source(Path('/tmp/u32s.h5'))"
  step "repro (ENCODED, DENSE load, bf)" soak_repro.log timeout 150 python3 $S repro --source "$REF" --rounds 6 --out "$R/soak_repro.json"
  step "device lost" soak_lost.log timeout 60 python3 $S lost --source /tmp/ref128/scan_master.h5 --out "$R/soak_lost.json"
  step "soak" soak.log timeout 300 python3 $S soak --ops 500 --seed 17 --sources ref128=/tmp/ref128/scan_master.h5:128x128:u16 \
    ref256=/tmp/ref256/scan_master.h5:256x256:u16 u32=/tmp/u32.h5:48x40:u32 --out "$R/soak_soak.json"
  step "200 load/close cycles (ENCODED)" soak_cycles.log timeout 120 python3 $S cycles --source /tmp/ref128/scan_master.h5 --out "$R/soak_cycles.json"
  step "200 load/close cycles (DENSE)" soak_cycles_dense.log timeout 120 python3 $S cycles --representation dense --source /tmp/ref128/scan_master.h5 --out "$R/soak_cycles_dense.json"
  step "4 threads" soak_threads.log timeout 60 python3 $S threads --source /tmp/ref128/scan_master.h5 --out "$R/soak_threads.json"
  local t n
  for t in memcheck racecheck synccheck; do
    n=200; [ $t = racecheck ] && n=60
    [ -n "$san" ] && step "soak under $t" soak_$t.log timeout 200 "$san" --tool $t --error-exitcode 9 python3 $S soak --ops $n --seed 5 \
      --sources u32=/tmp/u32s.h5:24x20:u32 small=/tmp/small/scan_master.h5:32x32:u16 --out "$R/soak_$t.json"
  done
  python3 - "$R" "$REC/${CARD}_reliability.json" <<'PY'
import json, pathlib, re, sys
r = pathlib.Path(sys.argv[1]); rec = {}
for f in sorted(r.glob("soak_*.json")):
    rec[f.stem[5:]] = json.loads(f.read_text())
for f in sorted(r.glob("soak_*check.log")):
    m = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: .*", f.read_text())
    rec.setdefault(f.stem[5:], {})["sanitizer_summary"] = m[-1] if m else "no summary (did not finish)"
rec["machine"] = (r / "machine.txt").read_text() if (r / "machine.txt").exists() else None
pathlib.Path(sys.argv[2]).write_text(json.dumps(rec, indent=1, default=str))
print({k: v.get("ok") for k, v in rec.items() if isinstance(v, dict)})
PY
}

mode_startup() { # issue 23: no compile on first use (bench/startup.py; four fresh processes)
  acquisition /tmp/ref
  step "startup (fresh processes)" startup.log timeout 400 python3 bench/startup.py "$REF" --out "$R/startup.json"
  cat "$R/startup.log"
  record "$R/startup.json" startup.json
}

with_dask() { # the device's Python has no Dask: unpack the wheels prepare_carry.sh carried (3.12)
  local site=/tmp/dask_site
  if [ ! -d "$site/distributed" ] && [ -d "$D/wheels" ]; then
    step "unpack dask[distributed] from the carry" dask_install.log bash -c \
      'for w in "$1"/*.whl; do python3 -m zipfile -e "$w" "$2" || exit 1; done' _ "$D/wheels" "$site"
  fi
  case ":$PYTHONPATH:" in *":$site:"*) ;; *) export PYTHONPATH=$PYTHONPATH:$site ;; esac
}

mode_distributed() { # issue 22: Dask workers sharing the card (tests/gpu/distributed_check.py)
  with_dask
  step "distributed check (128² × 192²)" distributed.log \
    timeout 400 python3 tests/gpu/distributed_check.py "$R/distributed.json" --scan 128 128 --det 192 192
  tail -20 "$R/distributed.log"
  record "$R/distributed.json" distributed_check.json
}

mode_serve() { # issue 19: the browse service's round trips on the 512² reference
  acquisition /tmp/ref
  step "serve latency (ENCODED)" serve_latency.log timeout 300 "$D/serve-latency" --source "$REF" --backend cuda \
    --requests 50 --out "$R/serve_latency.json"
  record "$R/serve_latency.json" serve_latency.json
}

modes=("$@")
[ "${modes[*]}" = all ] && modes=(checks load products ssb sanitize soak)
for m in "${modes[@]}"; do
  case $m in checks|load|lz4|products|ssb|sanitize|profile|soak|serve|startup|distributed) ;; *) echo "unknown mode: $m" >&2; usage ;; esac
done
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; cat /proc/loadavg
  echo "revision $QEM_GIT_REVISION; modes ${modes[*]}"; } > "$R/machine.txt" 2>&1
for m in "${modes[@]}"; do echo "== $m"; "mode_$m"; done
pack
echo "rc=$rc; records: $(ls "$REC" | tr '\n' ' ')"
exit $rc
