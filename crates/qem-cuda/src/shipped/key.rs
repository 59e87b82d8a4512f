// The key of a shipped kernel module, shared by `build.rs` (through `include!`) and the crate
// (`shipped::find`), so the two cannot drift apart. Plain items only (no inner docs): this file
// is pasted into both.

/// The shipped-module key: 64-bit FNV-1a over the module name, the exact source text NVRTC
/// compiles and the defines as sorted `NAME=VALUE` strings (sorted, so the order a wrapper lists
/// them in does not matter). The target (`sm_90`, PTX) is not part of it: one key has one entry
/// per target.
pub fn shipped_key(name: &str, src: &str, defines: &[(&str, &str)]) -> u64 {
    let mut d: Vec<String> = defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
    d.sort();
    let d = d.join(" ");
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in [name.as_bytes(), src.as_bytes(), d.as_bytes()] {
        for &b in p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff; // part separator
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A manifest line's `NAME=VALUE` tokens (src/kernels/shipped.txt) with the `{a,b,...}` value
/// lists expanded: one define list per combination, in token order; `None` when a token is not
/// `NAME=VALUE`. The build compiles these lists; the crate's tests check requests against them.
#[allow(dead_code)] // the library itself uses it only in its tests
pub fn expand_defines(tokens: &[&str]) -> Option<Vec<Vec<(String, String)>>> {
    let mut out: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for t in tokens {
        let (k, v) = t.split_once('=')?;
        let values: Vec<&str> = match v.strip_prefix('{').and_then(|v| v.strip_suffix('}')) {
            Some(list) => list.split(',').map(str::trim).collect(),
            None => vec![v],
        };
        out = out
            .into_iter()
            .flat_map(|d| {
                values.iter().map(move |v| {
                    let mut d = d.clone();
                    d.push((k.to_string(), v.to_string()));
                    d
                })
            })
            .collect();
    }
    Some(out)
}

/// The manifest's module lines (src/kernels/shipped.txt) as their whitespace-separated tokens,
/// `NAME SOURCES [DEFINE ...]`: comments (`#` to the end of the line) and blank lines dropped.
#[allow(dead_code)] // the library itself uses it only in its tests
pub fn manifest_tokens(text: &str) -> Vec<Vec<&str>> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect()
}
