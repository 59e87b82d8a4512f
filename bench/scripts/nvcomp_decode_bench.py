"""Decode throughput of NVIDIA nvCOMP 6 on the chunks of a Dectris acquisition, for comparison with
quantem.gpu's own bitshuffle/LZ4 kernel in the same run (issue 3).

    python nvcomp_decode_bench.py MASTER N_FRAMES OUT.json

Reads the raw chunks of the first N_FRAMES frames (h5py read_direct_chunk: no filter plugin needed),
repacks every LZ4 block payload into a 16-byte-aligned slot (nvCOMP's input alignment), decodes them
as one batch with nvCOMP LZ4 (RAW bitstream, one batch entry per bitshuffle block,
bitshuffle_mode=LSB_FIRST, which reproduces filter 32008's layout), times codec.decode with CUDA
events (3 warm-up + 10 timed), and checks the output byte-exactly against quantem.gpu's CPU engine.
Needs numpy, h5py, cupy, nvidia-nvcomp-cu13, quantem.gpu. 192x192 u16 frames have no raw tail.
"""
import json
import struct
import sys
import time

import cupy as cp
import h5py
import numpy as np
from nvidia import nvcomp

from quantem.gpu import io

master, n_frames, out_json = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t0 = time.perf_counter()
payloads, out_bytes, frames = [], 0, 0
with h5py.File(master, "r") as f:
    g = f["entry/data"]
    for name in sorted(k for k in g if k.startswith("data_")):
        d = g[name]
        for i in range(d.shape[0]):
            if frames == n_frames:
                break
            mask, raw = d.id.read_direct_chunk((i, 0, 0))
            assert mask == 0
            total, bsb = struct.unpack(">QI", raw[:12])
            assert total % bsb == 0, "this benchmark expects frames without a partial block or tail"
            p = 12
            for _ in range(total // bsb):
                (c,) = struct.unpack(">I", raw[p:p + 4])
                payloads.append(raw[p + 4 : p + 4 + c])
                p += 4 + c
            assert p == len(raw)
            out_bytes += total
            frames += 1
        if frames == n_frames:
            break
offs, sizes, slot = [], [], 0
for b in payloads:
    offs.append(slot)
    sizes.append(len(b))
    slot += (len(b) + 15) // 16 * 16
packed = np.zeros(slot, np.uint8)
for b, o in zip(payloads, offs):
    packed[o:o + len(b)] = np.frombuffer(b, np.uint8)
t_prep = time.perf_counter() - t0
dev = cp.asarray(packed)
codec = nvcomp.Codec(
    algorithm="LZ4",
    bitstream_kind=nvcomp.BitstreamKind.RAW,
    uncomp_chunk_size=bsb,
    data_type="<u2",
    bitshuffle_mode=nvcomp.BitshuffleMode.NVCOMP_BITSHUFFLE_LSB_FIRST,
)
batch = nvcomp.as_arrays(dev, offs, sizes)
times = []
for rep in range(13):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    out = codec.decode(batch, data_type="<u2")
    end.record()
    end.synchronize()
    if rep >= 3:
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    if rep < 12:
        del out
got = cp.concatenate([cp.asarray(o).view(cp.uint16).ravel() for o in out]).get()
rows = frames // 512
ref = io.load(master, backend="cpu", apply_mask=False, scan_region=(0, rows, 0, 512))
want = ref.to_numpy().reshape(-1)
exact = bool(np.array_equal(got[:want.size], want))
p50 = float(np.median(times))
rec = dict(
    tool="nvCOMP " + getattr(nvcomp, "__version__", "6"),
    frames=frames,
    blocks=len(payloads),
    compressed_bytes=int(sum(sizes)),
    decoded_bytes=int(out_bytes),
    prep_s=t_prep,
    decode_s=times,
    p50_s=p50,
    min_s=min(times),
    max_s=max(times),
    decoded_gb_s_p50=out_bytes / p50 / 1e9,
    byte_exact_vs_quantem_cpu=exact,
    compared_frames=int(want.size // (192 * 192)),
    method="codec.decode of one batch (one entry per 8 KiB bitshuffle block, 16-byte-aligned "
    "slots), CUDA events around the call incl. nvCOMP's output allocation",
)
json.dump(rec, open(out_json, "w"), indent=1)
print(
    f"nvCOMP: {frames} frames, {len(payloads)} blocks, p50 {p50 * 1e3:.2f} ms "
    f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}) = "
    f"{out_bytes / p50 / 1e9:.1f} GB/s decoded; byte-exact vs quantem CPU: {exact}"
)
