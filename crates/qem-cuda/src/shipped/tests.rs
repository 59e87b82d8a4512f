use super::*;

#[test]
fn arch_names_parse() {
    assert_eq!(parse_arch("sm_90"), Some((9, 0)));
    assert_eq!(parse_arch("sm_86"), Some((8, 6)));
    assert_eq!(parse_arch("sm_120"), Some((12, 0)));
    assert_eq!(parse_arch("sm_90a"), Some((9, 0)));
    assert_eq!(parse_arch("compute_90"), None);
}

#[test]
fn the_best_target_is_same_major_then_ptx() {
    let t = [80, 86, 89, 90, 100, 120, PTX_BASE + 120];
    assert_eq!(pick(&t, (9, 0)), Some(90));
    assert_eq!(pick(&t, (8, 7)), Some(86)); // Orin: the sm_86 CUBIN
    assert_eq!(pick(&t, (8, 9)), Some(89));
    assert_eq!(pick(&t, (10, 3)), Some(100)); // B300 runs the sm_100 CUBIN
    assert_eq!(pick(&t, (12, 1)), Some(120));
    assert_eq!(pick(&t, (13, 0)), Some(PTX_BASE + 120)); // newer than every CUBIN: PTX
    assert_eq!(pick(&t, (11, 0)), None); // no CUBIN of major 11, PTX 12.0 is too new
    assert_eq!(pick(&t, (7, 5)), None);
    assert_eq!(pick(&[90], (9, 0)), Some(90));
    assert_eq!(pick(&[], (9, 0)), None);
}

#[test]
fn the_key_ignores_define_order_and_sees_everything_else() {
    let k = shipped_key("a.cu", "src", &[("A", "1"), ("B", "2")]);
    assert_eq!(k, shipped_key("a.cu", "src", &[("B", "2"), ("A", "1")]));
    assert_ne!(k, shipped_key("a.cu", "src", &[("A", "1"), ("B", "3")]));
    assert_ne!(k, shipped_key("a.cu", "src ", &[("A", "1"), ("B", "2")]));
    assert_ne!(k, shipped_key("b.cu", "src", &[("A", "1"), ("B", "2")]));
    assert_ne!(k, shipped_key("a.cu", "src", &[("A", "1")]));
}

/// The `NAME=VALUE` defines of every manifest line, with `{a,b}` lists unexpanded.
fn manifest_lines() -> Vec<(String, Vec<String>, Vec<String>)> {
    manifest_tokens(include_str!("../kernels/shipped.txt"))
        .into_iter()
        .map(|t| {
            let defs = t[2..]
                .iter()
                .map(|d| d.split('=').next().unwrap_or("").to_string())
                .collect();
            (
                t[0].to_string(),
                t[1].split('+').map(str::to_string).collect(),
                defs,
            )
        })
        .collect()
}

/// The macros a source sets a default for (`#ifndef NAME` … `#define NAME`): the defines a
/// wrapper may pass.
fn source_macros(src: &str) -> Vec<String> {
    let mut v: Vec<String> = src
        .lines()
        .filter_map(|l| l.trim().strip_prefix("#ifndef "))
        .map(|n| n.trim().to_string())
        .filter(|n| !n.ends_with("_H") && !n.ends_with("_CU"))
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Every manifest line passes exactly the macros its sources read (so a define added to a
/// kernel without the manifest following fails here, instead of silently missing the pack),
/// and the sources exist.
#[test]
fn the_manifest_names_every_define_its_sources_read() {
    let files: &[(&str, &str)] = &[
        (
            "bslz4_decode.cu",
            include_str!("../kernels/bslz4_decode.cu"),
        ),
        ("region_bin.cu", include_str!("../kernels/region_bin.cu")),
        ("rans.cu", include_str!("../kernels/rans.cu")),
        ("ssb.cu", include_str!("../kernels/ssb.cu")),
        ("dpc.cu", include_str!("../kernels/dpc.cu")),
        ("fault.cu", include_str!("../kernels/fault.cu")),
        (
            "device_forms.cu",
            include_str!("../kernels/device_forms.cu"),
        ),
        ("products.cu", include_str!("../kernels/products.cu")),
    ];
    let lines = manifest_lines();
    assert!(lines.len() >= 7, "{lines:?}");
    for (name, sources, defs) in lines {
        let mut want = Vec::new();
        for s in &sources {
            let text = files
                .iter()
                .find(|f| f.0 == s)
                .unwrap_or_else(|| panic!("{name}: unknown source {s}"))
                .1;
            want.extend(source_macros(text));
        }
        want.sort();
        want.dedup();
        let mut got = defs.clone();
        got.sort();
        assert_eq!(
            got, want,
            "{name} ({sources:?}): defines of the manifest line"
        );
    }
}

/// The wrappers' module sources are the manifest's (same files, same concatenation), so the
/// keys the build computed are the keys the wrappers look up.
#[test]
fn wrapper_sources_match_the_manifest() {
    let products = format!(
        "{}\n{}",
        include_str!("../kernels/rans.cu"),
        include_str!("../kernels/products.cu")
    );
    assert_eq!(
        format!(
            "{}\n{}",
            crate::rans::KERNEL_SOURCE,
            include_str!("../kernels/products.cu")
        ),
        products
    );
    assert_eq!(
        crate::bslz4::KERNEL_SOURCE,
        include_str!("../kernels/bslz4_decode.cu")
    );
    assert_eq!(
        crate::transform::KERNEL_SOURCE,
        include_str!("../kernels/region_bin.cu")
    );
}

/// With a pack (a build with the feature and $QEM_NVRTC), every manifest module of the engine
/// start is in it for every CUBIN target and decompresses to an ELF; without one, `find` says
/// nothing.
#[test]
fn the_pack_serves_the_engine_modules_or_is_empty() {
    let s = summary();
    let threads = "256";
    let q = (
        "bslz4_decode.cu",
        crate::bslz4::KERNEL_SOURCE,
        [("QEM_MAX_THREADS", threads)],
    );
    if s.entries == 0 || s.disabled {
        assert!(find(q.0, q.1, &q.2, "sm_90").is_none());
        return;
    }
    for arch in [
        "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120",
    ] {
        let m = find(q.0, q.1, &q.2, arch).unwrap_or_else(|| panic!("bslz4 for {arch}"));
        assert!(
            !m.ptx && m.image.starts_with(b"\x7fELF"),
            "{arch}: {}",
            m.target
        );
    }
    let m = find(q.0, q.1, &q.2, "sm_130").expect("PTX for a newer device");
    assert!(m.ptx && String::from_utf8_lossy(&m.image).contains(".entry"));
    // Another source (an edit since the build) is not served.
    assert!(find(q.0, "// edited\n", &q.2, "sm_90").is_none());
    assert!(find(q.0, q.1, &[("QEM_MAX_THREADS", "128")], "sm_90").is_none());
    let rans = find("rans.cu", crate::rans::KERNEL_SOURCE, &[], "sm_90").expect("rans.cu");
    assert!(rans.image.starts_with(b"\x7fELF"));
}
