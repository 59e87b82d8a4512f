//! Gatan `.dm4`/`.dm3` stacks: files written here from the documented layout (docs/formats.md
//! §7.10; tests/python/test_dm.py checks the same layout against rosettasciio's reader), read
//! back byte for byte, with their calibrations; malformed ones give typed errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use qem_core::{ErrorKind, Shape2};
use qem_io::{FloatScale, OpenOptions, Source, SourceKind};
use std::path::Path;

/// A tag's content.
enum T {
    Group(Vec<(&'static str, T)>),
    U32(u32),
    F32(f32),
    /// Text as a u16 array (how GMS stores units).
    Text(&'static str),
    /// An array of simple type `elem` (2-byte u16 = 4, u32 = 5, f32 = 6, u8 = 10) whose values
    /// are already encoded.
    Array {
        elem: u64,
        count: u64,
        bytes: Vec<u8>,
    },
}

/// Writes the layout: big-endian structure, values in the chosen byte order.
struct Writer {
    v4: bool,
    little: bool,
    out: Vec<u8>,
}

impl Writer {
    fn len(&mut self, v: u64) {
        if self.v4 {
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            self.out.extend_from_slice(&(v as u32).to_be_bytes());
        }
    }
    fn value32(&mut self, b: [u8; 4]) {
        let mut b = b;
        if !self.little {
            b.reverse();
        }
        self.out.extend_from_slice(&b);
    }
    fn group(&mut self, entries: &[(&str, T)]) {
        self.out.extend_from_slice(&[0, 1]);
        self.len(entries.len() as u64);
        for (name, t) in entries {
            self.tag(name, t);
        }
    }
    fn tag(&mut self, name: &str, t: &T) {
        self.out
            .push(if matches!(t, T::Group(_)) { 20 } else { 21 });
        self.out
            .extend_from_slice(&(name.len() as u16).to_be_bytes());
        self.out.extend_from_slice(name.as_bytes());
        let size_at = self.out.len();
        if self.v4 {
            self.out.extend_from_slice(&[0; 8]);
        }
        let start = self.out.len();
        match t {
            T::Group(entries) => self.group(entries),
            T::U32(v) => {
                self.data_head(&[5]);
                self.value32(v.to_le_bytes());
            }
            T::F32(v) => {
                self.data_head(&[6]);
                self.value32(v.to_le_bytes());
            }
            T::Text(s) => {
                self.data_head(&[20, 4, s.len() as u64]);
                for c in s.encode_utf16() {
                    let b = if self.little {
                        c.to_le_bytes()
                    } else {
                        c.to_be_bytes()
                    };
                    self.out.extend_from_slice(&b);
                }
            }
            T::Array { elem, count, bytes } => {
                self.data_head(&[20, *elem, *count]);
                self.out.extend_from_slice(bytes);
            }
        }
        if self.v4 {
            let size = (self.out.len() - start) as u64;
            self.out[size_at..size_at + 8].copy_from_slice(&size.to_be_bytes());
        }
    }
    fn data_head(&mut self, info: &[u64]) {
        self.out.extend_from_slice(b"%%%%");
        self.len(info.len() as u64);
        for &i in info {
            self.len(i);
        }
    }
}

fn write_dm(path: &Path, v4: bool, little: bool, root: &[(&'static str, T)]) {
    let mut w = Writer {
        v4,
        little,
        out: Vec::new(),
    };
    w.group(root);
    let body = w.out;
    let mut file = Vec::new();
    file.extend_from_slice(&(if v4 { 4u32 } else { 3 }).to_be_bytes());
    if v4 {
        file.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        file.extend_from_slice(&(body.len() as u32).to_be_bytes());
    }
    file.extend_from_slice(&u32::from(little).to_be_bytes());
    file.extend_from_slice(&body);
    std::fs::write(path, file).unwrap();
}

/// One `ImageList` entry: dimensions fastest first, DataType, data, calibrations.
fn image(
    dims: &[u32],
    data_type: u32,
    elem: u64,
    bytes: Vec<u8>,
    cal: Vec<(f32, &'static str)>,
) -> T {
    // The array holds what `bytes` holds, whatever the dimensions claim.
    let width = match elem {
        2 | 4 => 2,
        8..=10 => 1,
        7 | 11 | 12 => 8,
        _ => 4,
    };
    let count = bytes.len() as u64 / width;
    T::Group(vec![(
        "ImageData",
        T::Group(vec![
            (
                "Calibrations",
                T::Group(vec![(
                    "Dimension",
                    T::Group(
                        cal.into_iter()
                            .map(|(s, u)| {
                                (
                                    "",
                                    T::Group(vec![
                                        ("Origin", T::F32(0.0)),
                                        ("Scale", T::F32(s)),
                                        ("Units", T::Text(u)),
                                    ]),
                                )
                            })
                            .collect(),
                    ),
                )]),
            ),
            ("Data", T::Array { elem, count, bytes }),
            ("DataType", T::U32(data_type)),
            (
                "Dimensions",
                T::Group(dims.iter().map(|&d| ("", T::U32(d))).collect()),
            ),
        ]),
    )])
}

fn frames_of(src: &Source) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for rec in &src.chunks {
        src.read_chunk(rec, &mut buf).unwrap();
        out.extend_from_slice(&buf);
    }
    out
}

fn counts(n: usize) -> Vec<u16> {
    (0..n).map(|i| ((i * 7919) % 4099) as u16).collect()
}

/// A GMS-like DM4: a 2-D thumbnail first (listed under `Thumbnails`), then the 4-D stack with
/// calibrations and the microscope voltage.
fn gms_like(path: &Path, data: &[u16], dims: [u32; 4]) {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    let thumb = image(&[4, 4], 6, 10, vec![7; 16], vec![]);
    let stack = image(
        &dims,
        10,
        4,
        bytes,
        vec![(0.5, "mrad"), (0.5, "mrad"), (0.04, "nm"), (0.04, "nm")],
    );
    let T::Group(mut stack) = stack else {
        unreachable!()
    };
    stack.push((
        "ImageTags",
        T::Group(vec![(
            "Microscope Info",
            T::Group(vec![("Voltage", T::F32(300_000.0))]),
        )]),
    ));
    write_dm(
        path,
        true,
        true,
        &[
            (
                "ImageList",
                T::Group(vec![("", thumb), ("", T::Group(stack))]),
            ),
            (
                "Thumbnails",
                T::Group(vec![("", T::Group(vec![("ImageIndex", T::U32(0))]))]),
            ),
        ],
    );
}

/// `scan.dm4` in `dir`: a GMS-like 4-D stack of R = 3, C = 4, k_r = 5, k_c = 6 (dimensions
/// fastest first: 6, 5, 4, 3), and its counts.
fn scan_dm4(dir: &Path) -> (std::path::PathBuf, Vec<u16>) {
    let p = dir.join("scan.dm4");
    let data = counts(3 * 4 * 5 * 6);
    gms_like(&p, &data, [6, 5, 4, 3]);
    (p, data)
}

#[test]
fn dm4_4d_u16_reads_byte_exact_with_calibration() {
    let dir = tempfile::tempdir().unwrap();
    let (p, data) = scan_dm4(dir.path());
    let src = Source::open(&p, &OpenOptions::default()).unwrap();
    assert_eq!(src.kind, SourceKind::GatanDm);
    assert_eq!(src.scan_shape, Shape2::new(3, 4));
    assert_eq!(src.detector_shape, Shape2::new(5, 6));
    assert_eq!(src.n_frames, 12);
    assert!(!src.needs_host_decode());
    let want: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(frames_of(&src), want);
    let m = &src.metadata;
    assert_eq!(m.angular_sampling_mrad, Some((0.5, 0.5)));
    let (r, c) = m.scan_step_a.unwrap();
    assert!((r - 0.4).abs() < 1e-6 && (c - 0.4).abs() < 1e-6, "{r} {c}");
    assert_eq!(m.energy_ev, Some(300_000.0));
    assert_eq!(m.extra["gatan_dm"]["image_index"], 1);
}

#[test]
fn dm3_frames_big_endian_and_float() {
    let dir = tempfile::tempdir().unwrap();
    // DM3, big-endian u32 values, 3-D (frames): the loader swaps them.
    let p = dir.path().join("frames.dm3");
    let vals: Vec<u32> = (0..2 * 3 * 7).map(|i| i * 70_001).collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_be_bytes()).collect();
    write_dm(
        &p,
        false,
        false,
        &[(
            "ImageList",
            T::Group(vec![("", image(&[2, 3, 7], 11, 5, bytes, vec![]))]),
        )],
    );
    let opts = OpenOptions {
        scan_shape: Some(Shape2::new(7, 1)),
        ..OpenOptions::default()
    };
    let src = Source::open(&p, &opts).unwrap();
    assert_eq!(src.detector_shape, Shape2::new(3, 2));
    assert_eq!(src.n_frames, 7);
    assert!(src.needs_host_decode());
    let swapped: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(frames_of(&src), swapped, "frames come out little-endian");

    // float32 frames need float_scale, like every float source.
    let p = dir.path().join("gain.dm4");
    let f: Vec<u8> = (0..2 * 2 * 4)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    write_dm(
        &p,
        true,
        true,
        &[(
            "ImageList",
            T::Group(vec![("", image(&[2, 2, 2, 2], 2, 6, f, vec![]))]),
        )],
    );
    let e = Source::open(&p, &OpenOptions::default()).unwrap_err();
    assert!(e.to_string().contains("float_scale"), "{e}");
    let opts = OpenOptions {
        float_scale: Some(FloatScale(0.5)),
        ..OpenOptions::default()
    };
    let src = Source::open(&p, &opts).unwrap();
    assert_eq!(src.scan_shape, Shape2::new(2, 2));
    assert!(src.needs_host_decode());
}

/// The error of opening a DM4 holding only `image`.
fn one_image(dir: &Path, name: &str, image: T) -> qem_core::Error {
    let q = dir.join(name);
    write_dm(
        &q,
        true,
        true,
        &[("ImageList", T::Group(vec![("", image)]))],
    );
    Source::open(&q, &OpenOptions::default()).unwrap_err()
}

#[test]
fn malformed_dm_files_give_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (p, data) = scan_dm4(dir.path());
    let whole = std::fs::read(&p).unwrap();
    let open = |bytes: &[u8]| {
        let q = dir.path().join("bad.dm4");
        std::fs::write(&q, bytes).unwrap();
        Source::open(&q, &OpenOptions::default()).unwrap_err()
    };

    // Cut inside the data array: the value runs past the end.
    let e = open(&whole[..whole.len() - 300]);
    assert_eq!(e.kind, ErrorKind::Source);
    assert!(e.to_string().contains("truncated"), "{e}");
    assert!(e.to_string().contains("bad.dm4"), "{e}");

    // Cut inside the tag tree.
    let e = open(&whole[..40]);
    assert!(e.to_string().contains("malformed"), "{e}");

    // Dimensions that do not match the data: claim a 7-wide detector.
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    let e = one_image(
        dir.path(),
        "dims.dm4",
        image(&[7, 5, 4, 3], 10, 4, bytes, vec![]),
    );
    assert!(
        e.to_string().contains("does not match its dimensions"),
        "{e}"
    );

    // Complex and RGB images are not counts: refused by name.
    for (code, name) in [(3, "complex"), (13, "complex"), (23, "RGB")] {
        let e = one_image(
            dir.path(),
            "complex.dm4",
            image(&[2, 2, 2], code, 6, vec![0; 32], vec![]),
        );
        assert_eq!(e.kind, ErrorKind::Source);
        assert!(
            e.to_string().contains(&format!("DataType {code} ({name})")),
            "{e}"
        );
    }
    // An unlisted DataType over an array that is not 64-bit integers: refused.
    let e = one_image(
        dir.path(),
        "unknown.dm4",
        image(&[2, 2, 2], 39, 5, vec![0; 32], vec![]),
    );
    assert!(
        e.to_string().contains("DataType 39 (an unknown type)"),
        "{e}"
    );

    // Only a 2-D image: says what it found.
    let e = one_image(
        dir.path(),
        "flat.dm4",
        image(&[4, 4], 6, 10, vec![1; 16], vec![]),
    );
    assert!(
        e.to_string().contains("no 3-D or 4-D image") && e.to_string().contains("[4, 4]"),
        "{e}"
    );

    // Groups nested 100 deep: refused, not recursed into.
    let mut deep = vec![0u8, 0, 0, 4];
    deep.extend_from_slice(&0u64.to_be_bytes());
    deep.extend_from_slice(&1u32.to_be_bytes());
    for _ in 0..100 {
        deep.extend_from_slice(&[0, 1]);
        deep.extend_from_slice(&1u64.to_be_bytes());
        deep.extend_from_slice(&[20, 0, 1, b'g']);
        deep.extend_from_slice(&0u64.to_be_bytes());
    }
    let e = open(&deep);
    assert!(e.to_string().contains("nest deeper"), "{e}");

    // A wrong version is not read as DM.
    let mut v5 = whole.clone();
    v5[3] = 5;
    let e = Source::open(
        &{
            let q = dir.path().join("v5.dm4");
            std::fs::write(&q, &v5).unwrap();
            q
        },
        &OpenOptions {
            format: Some(qem_io::Format::Dm),
            ..OpenOptions::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("version 5"), "{e}");
}

/// Every value of `v` as bytes, by `f` (`to_le_bytes`, `to_be_bytes`).
macro_rules! bytes {
    ($v:expr, $f:ident) => {
        $v.iter().flat_map(|x| x.$f()).collect::<Vec<u8>>()
    };
}

/// A DM4 holding one 3-D image of 3 frames of 2 × 2 (dimensions `[2, 2, 3]`), DataType `code`,
/// an array of value type `elem`, values in the given byte order, opened with
/// `float_scale = 0.5`: its dtype and its frames decoded, or the first record's error.
fn decode_frames(
    dir: &Path,
    name: &str,
    (code, elem, little): (u32, u64, bool),
    bytes: Vec<u8>,
) -> (qem_core::DType, Result<Vec<u8>, qem_core::Error>) {
    let p = dir.join(name);
    write_dm(
        &p,
        true,
        little,
        &[(
            "ImageList",
            T::Group(vec![("", image(&[2, 2, 3], code, elem, bytes, vec![]))]),
        )],
    );
    let opts = OpenOptions {
        scan_shape: Some(Shape2::new(1, 3)),
        float_scale: Some(FloatScale(0.5)),
        ..OpenOptions::default()
    };
    let src = Source::open(&p, &opts).unwrap();
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for rec in &src.chunks {
        if let Err(e) = src.read_chunk(rec, &mut buf) {
            return (src.dtype, Err(e));
        }
        out.extend_from_slice(&buf);
    }
    (src.dtype, Ok(out))
}

/// Signed integers load as the unsigned counts of their width, float64 through float_scale,
/// 64-bit integers (recognised by the array's value type under an unlisted DataType code) as
/// u32 — byte for byte, either byte order.
#[test]
fn signed_float64_and_64_bit_images_decode() {
    use qem_core::DType;
    let dir = tempfile::tempdir().unwrap();
    let i16s: Vec<i16> = (0..12).map(|i| i * 1000).collect();
    let i32s: Vec<i32> = (0..12).map(|i| i * 100_003).collect();
    let f64s: Vec<f64> = (0..12).map(|i| f64::from(i) * 1.5 + 0.2).collect();
    let u64s: Vec<u64> = (0..12).map(|i| i * 300_000_007 % 4_294_967_296).collect();
    let as_u16: Vec<u16> = i16s.iter().map(|&x| x as u16).collect();
    let as_u32: Vec<u32> = i32s.iter().map(|&x| x as u32).collect();
    // round((1.5 i + 0.2) / 0.5) = 3 i
    let thirds: Vec<u32> = (0..12).map(|i| 3 * i).collect();
    let narrowed: Vec<u32> = u64s.iter().map(|&x| x as u32).collect();
    let i8s = vec![0, 1, 127, 3, 4, 5, 6, 7, 8, 9, 10, 11];
    let (i16_le, i32_be) = (bytes!(i16s, to_le_bytes), bytes!(i32s, to_be_bytes));
    let (f64_le, u64_be) = (bytes!(f64s, to_le_bytes), bytes!(u64s, to_be_bytes));
    let (u16_want, u32_want) = (bytes!(as_u16, to_le_bytes), bytes!(as_u32, to_le_bytes));
    let (f64_want, u64_want) = (bytes!(thirds, to_le_bytes), bytes!(narrowed, to_le_bytes));
    let cases = [
        ("i16.dm4", (1, 2, true), i16_le, DType::U16, u16_want),
        ("i32.dm4", (7, 3, false), i32_be, DType::U32, u32_want),
        ("i8.dm4", (9, 9, true), i8s.clone(), DType::U8, i8s),
        ("f64.dm4", (12, 7, true), f64_le, DType::U32, f64_want),
        ("u64.dm4", (40, 12, false), u64_be, DType::U32, u64_want),
    ];
    for (name, kind, stored, dtype, want) in cases {
        let (got_dtype, frames) = decode_frames(dir.path(), name, kind, stored);
        assert_eq!(got_dtype, dtype, "{name}");
        assert_eq!(frames.unwrap(), want, "{name}");
    }
}

/// A value that is not a count (negative, or past u32::MAX for 64-bit values): a decode error
/// naming the file, frame, pixel and value.
#[test]
fn values_that_are_not_counts_are_decode_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut i8s = [3u8; 12];
    i8s[9] = (-5i8) as u8; // frame 2, pixel 1
    let mut big: Vec<u64> = (0..12).collect();
    big[6] = 1 << 32; // frame 1, pixel 2
    let neg: Vec<i64> = (0..12).map(|i| if i == 3 { -1 } else { i }).collect();
    let mut i16s: Vec<i16> = (0..12).collect();
    i16s[11] = -300; // frame 2, pixel 3, big-endian
    let cases = [
        ("i8.dm4", (9, 9, true), i8s.to_vec(), 2, 1, "-5"),
        (
            "big.dm4",
            (40, 12, true),
            bytes!(big, to_le_bytes),
            1,
            2,
            "4294967296",
        ),
        (
            "neg.dm4",
            (39, 11, true),
            bytes!(neg, to_le_bytes),
            0,
            3,
            "-1",
        ),
        (
            "i16.dm4",
            (1, 2, false),
            bytes!(i16s, to_be_bytes),
            2,
            3,
            "-300",
        ),
    ];
    for (name, kind, stored, frame, pixel, found) in cases {
        let e = decode_frames(dir.path(), name, kind, stored).1.unwrap_err();
        assert_eq!(
            (e.kind, e.frame),
            (ErrorKind::Decode, Some(frame)),
            "{name}"
        );
        assert_eq!(e.found.as_deref(), Some(found), "{name}");
        let text = e.to_string();
        assert!(
            text.contains(&format!("pixel {pixel}")) && text.contains(name),
            "{text}"
        );
    }
}
