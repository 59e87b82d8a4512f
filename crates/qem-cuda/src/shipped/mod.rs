//! Kernel modules compiled at build time and shipped inside the library (`build.rs`, manifest
//! `src/kernels/shipped.txt`): CUBINs for sm_80, 86, 89, 90, 100 and 120 and PTX for
//! compute_120, LZ4-compressed, looked up by [`shipped_key`] (module name, exact source text,
//! defines) so an entry is used only for the source it was compiled from. A device gets the
//! CUBIN of its own major version with the highest minor not above its own (a CUBIN for
//! `sm_XY` runs on `sm_XZ`, Z ≥ Y); failing that, PTX of a target not above it (JIT-compiled by
//! the driver); failing that, nothing, and `nvrtc::load_module` compiles as before.
//! `QEM_KERNELS=nvrtc` turns the pack off (e.g. for `-lineinfo` under a profiler).

include!("key.rs");

mod index {
    include!(concat!(env!("OUT_DIR"), "/shipped_index.rs"));
}

static PACK: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/shipped_pack.bin"));

/// Targets at and above this are PTX (`compute_{t - PTX_BASE}`).
const PTX_BASE: u32 = 1000;

/// A module found in the pack.
#[derive(Debug, Clone)]
pub struct Shipped {
    /// The CUBIN (ELF) or the PTX text (NUL-free).
    pub image: Vec<u8>,
    /// `"sm_90"` for a CUBIN, `"compute_120"` for PTX.
    pub target: String,
    /// Whether `image` is PTX.
    pub ptx: bool,
    /// The key, as hex.
    pub key: String,
}

/// What the pack holds, for logs and records: how it was built and its size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PackSummary {
    /// Entries (module × target).
    pub entries: usize,
    /// Distinct modules.
    pub modules: usize,
    /// Compressed bytes in the library.
    pub packed_bytes: usize,
    /// Bytes of CUBIN and PTX once decompressed.
    pub raw_bytes: usize,
    /// NVRTC `(major, minor)` that compiled it (`(0, 0)` when empty).
    pub nvrtc: (i32, i32),
    /// The build script's note (why empty, or what it holds).
    pub status: &'static str,
    /// Whether `QEM_KERNELS=nvrtc` turns it off in this process.
    pub disabled: bool,
}

/// The pack's summary.
pub fn summary() -> PackSummary {
    let e = index::ENTRIES;
    let mut keys: Vec<u64> = e.iter().map(|x| x.0).collect();
    keys.dedup();
    PackSummary {
        entries: e.len(),
        modules: keys.len(),
        packed_bytes: PACK.len(),
        raw_bytes: e.iter().map(|x| x.4 as usize).sum(),
        nvrtc: index::NVRTC,
        status: index::STATUS,
        disabled: disabled(),
    }
}

/// Whether the pack holds anything (and is not turned off): then NVRTC is not needed to open
/// a device.
pub fn available() -> bool {
    !index::ENTRIES.is_empty() && !disabled()
}

fn disabled() -> bool {
    std::env::var("QEM_KERNELS").is_ok_and(|v| v.eq_ignore_ascii_case("nvrtc"))
}

/// `"sm_90"` → `(9, 0)`, `"sm_120"` → `(12, 0)`, `"sm_86"` → `(8, 6)`.
fn parse_arch(arch: &str) -> Option<(u32, u32)> {
    let n: u32 = arch
        .strip_prefix("sm_")?
        .trim_end_matches(['a', 'f'])
        .parse()
        .ok()?;
    Some((n / 10, n % 10))
}

/// The pack's best target for a device of compute capability `(major, minor)` among `targets`
/// (SM numbers, PTX as [`PTX_BASE`] + number).
fn pick(targets: &[u32], (major, minor): (u32, u32)) -> Option<u32> {
    let dev = major * 10 + minor;
    let sass = targets
        .iter()
        .copied()
        .filter(|&t| t < PTX_BASE && t / 10 == major && t % 10 <= minor)
        .max();
    sass.or_else(|| {
        targets
            .iter()
            .copied()
            .filter(|&t| t >= PTX_BASE && t - PTX_BASE <= dev)
            .max()
    })
}

/// The shipped module `name` compiled from `src` with `defines` for a device of `arch`
/// (`"sm_90"`), if the pack has one that runs there.
pub fn find(name: &str, src: &str, defines: &[(&str, &str)], arch: &str) -> Option<Shipped> {
    if !available() {
        return None;
    }
    let cc = parse_arch(arch)?;
    let key = shipped_key(name, src, defines);
    let e = index::ENTRIES;
    let lo = e.partition_point(|x| x.0 < key);
    let hi = e.partition_point(|x| x.0 <= key);
    let here = &e[lo..hi];
    let targets: Vec<u32> = here.iter().map(|x| x.1).collect();
    let t = pick(&targets, cc)?;
    let &(_, _, off, len, raw) = here.iter().find(|x| x.1 == t)?;
    let z = PACK.get(off as usize..(off as usize + len as usize))?;
    let mut image = lz4_flex::block::decompress(z, raw as usize).ok()?;
    let ptx = t >= PTX_BASE;
    if ptx {
        // NVRTC's PTX ends in a NUL; cudarc adds its own.
        while image.last() == Some(&0) {
            image.pop();
        }
    }
    Some(Shipped {
        image,
        target: if ptx {
            format!("compute_{}", t - PTX_BASE)
        } else {
            format!("sm_{t}")
        },
        ptx,
        key: format!("{key:016x}"),
    })
}

#[cfg(test)]
mod tests;
