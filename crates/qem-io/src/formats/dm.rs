//! Gatan Digital Micrograph `.dm4`/`.dm3` 3-D and 4-D stacks.
//!
//! A DM file is a tree of tags after a 12-byte (DM3) or 16-byte (DM4) header: version (3 or 4),
//! root length (u32 / u64), and the byte order of the *values* (1 = little-endian); everything
//! structural (tag ids, name lengths, info arrays) is big-endian. A group is `sorted u8, open
//! u8, n_tags`; a tag is `id u8 (20 group, 21 data), name length u16, name`, then in DM4 a u64
//! tag length, then the group or `"%%%%", n_info, info[n_info]` and the value. `n_info`, the
//! info entries and the DM4 lengths are u64 in DM4 and u32 in DM3. docs/formats.md §7.10 has
//! the layout and the value types.
//!
//! The images are `ImageList`'s unnamed groups; those `Thumbnails/*/ImageIndex` names are
//! previews. The first other image with 3 or 4 dimensions is the acquisition: `ImageData/
//! Dimensions` lists the axes fastest first, so dimensions `[k_c, k_r, C, R]` are the C-order
//! array `(R, C, k_r, k_c)` — frames contiguous, one per probe position — and `ImageData/Data`
//! is one array whose offset we record; the frames are then read in place like `.npy`.
//!
//! Only the tags this needs are decoded; every other value is skipped by its computed size,
//! which is checked against the file's length, so a corrupt file is an error naming the file,
//! never a read past its end. Depth, tag count and info length are bounded (a small file cannot
//! make the parser build a large tree).

use super::{build, host::ElemConv, Found, Strided};
use crate::{guard, OpenOptions, Source, SourceKind};
use qem_core::{DType, Error, Metadata, Result, Shape2};
use std::io::{BufReader, Read};
use std::path::Path;

const OP: &str = "open";
/// Group nesting deeper than this is not a DM file GMS writes (it nests about 8 deep).
const MAX_DEPTH: usize = 64;
/// Tags in one file; GMS files carry thousands.
const MAX_TAGS: u64 = 2_000_000;
/// Entries of one info array (a struct of n fields takes 2n + 3).
const MAX_INFO: u64 = 4_096;
/// Arrays up to this many elements are decoded (short text stored as u16 arrays: units).
const SMALL_ARRAY: u64 = 256;

/// A decoded value of a data tag.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Int(i64),
    Float(f64),
    /// An array of a simple type, left in the file: where its values start, how many, and the
    /// value type code; a short u16/u8 array is also read as text (units are stored so).
    Array {
        offset: u64,
        count: u64,
        elem: u64,
        text: Option<String>,
    },
    /// Anything else (structs, strings, arrays of structs): skipped.
    Other,
}

/// A tag tree: a group's entries in file order, unnamed tags with an empty name.
#[derive(Debug, Default)]
struct Group {
    entries: Vec<(String, Node)>,
}

#[derive(Debug)]
enum Node {
    Group(Group),
    Data(Value),
}

impl Group {
    fn get(&self, name: &str) -> Option<&Node> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
    fn group(&self, name: &str) -> Option<&Group> {
        match self.get(name)? {
            Node::Group(g) => Some(g),
            Node::Data(_) => None,
        }
    }
    fn value(&self, name: &str) -> Option<&Value> {
        match self.get(name)? {
            Node::Data(v) => Some(v),
            Node::Group(_) => None,
        }
    }
    fn int(&self, name: &str) -> Option<i64> {
        match self.value(name)? {
            Value::Int(i) => Some(*i),
            Value::Float(f) if f.fract() == 0.0 => Some(*f as i64),
            _ => None,
        }
    }
    fn float(&self, name: &str) -> Option<f64> {
        match self.value(name)? {
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }
    fn text(&self, name: &str) -> Option<&str> {
        match self.value(name)? {
            Value::Array { text, .. } => text.as_deref(),
            _ => None,
        }
    }
    /// The sub-groups, in order (the entries of a list such as `ImageList`).
    fn groups(&self) -> impl Iterator<Item = &Group> {
        self.entries.iter().filter_map(|(_, v)| match v {
            Node::Group(g) => Some(g),
            Node::Data(_) => None,
        })
    }
    /// The values, in order (the entries of `Dimensions`).
    fn values(&self) -> impl Iterator<Item = &Value> {
        self.entries.iter().filter_map(|(_, v)| match v {
            Node::Data(d) => Some(d),
            Node::Group(_) => None,
        })
    }
}

/// Bytes of one value of a simple type code, `None` for a code that is not simple.
fn simple_size(code: u64) -> Option<u64> {
    Some(match code {
        2 | 4 => 2,       // i16, u16
        3 | 5 | 6 => 4,   // i32, u32, f32
        7 | 11 | 12 => 8, // f64, i64, u64
        8..=10 => 1,      // bool, i8 (char), u8 (octet)
        _ => return None,
    })
}

/// The tag parser: positioned reads over a buffered file, every length checked against the
/// file's size.
struct Parser<'p> {
    f: BufReader<std::fs::File>,
    path: &'p Path,
    pos: u64,
    len: u64,
    v4: bool,
    little: bool,
    tags: u64,
}

impl Parser<'_> {
    fn corrupt(&self, what: impl Into<String>) -> Error {
        Error::source(OP, format!("Gatan DM file is malformed: {}", what.into()))
            .with_file(self.path)
            .with_found(format!("at byte {} of {}", self.pos, self.len))
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        if self.pos + N as u64 > self.len {
            return Err(self.corrupt("it ends inside a tag (truncated?)"));
        }
        let mut b = [0u8; N];
        self.f
            .read_exact(&mut b)
            .map_err(|e| Error::io(OP, self.path, &e))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn skip(&mut self, n: u64) -> Result<()> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.len => {
                let step = i64::try_from(n).map_err(|_| self.corrupt("a length past 2^63"))?;
                self.f
                    .seek_relative(step)
                    .map_err(|e| Error::io(OP, self.path, &e))?;
                self.pos = end;
                Ok(())
            }
            _ => Err(self.corrupt(format!(
                "a value of {n} bytes runs past the end of the file (truncated?)"
            ))),
        }
    }

    /// A structural length: u64 in DM4, u32 in DM3, big-endian.
    fn len_field(&mut self) -> Result<u64> {
        Ok(if self.v4 {
            u64::from_be_bytes(self.bytes::<8>()?)
        } else {
            u64::from(u32::from_be_bytes(self.bytes::<4>()?))
        })
    }

    /// One value of a simple type, in the file's value byte order.
    fn simple(&mut self, code: u64) -> Result<Value> {
        macro_rules! num {
            ($t:ty, $n:literal) => {{
                let b = self.bytes::<$n>()?;
                if self.little {
                    <$t>::from_le_bytes(b)
                } else {
                    <$t>::from_be_bytes(b)
                }
            }};
        }
        Ok(match code {
            2 => Value::Int(num!(i16, 2).into()),
            4 => Value::Int(num!(u16, 2).into()),
            3 => Value::Int(num!(i32, 4).into()),
            5 => Value::Int(num!(u32, 4).into()),
            6 => Value::Float(num!(f32, 4).into()),
            7 => Value::Float(num!(f64, 8)),
            11 => Value::Int(num!(i64, 8)),
            12 => Value::Int(i64::try_from(num!(u64, 8)).unwrap_or(i64::MAX)),
            8 | 10 => Value::Int(self.bytes::<1>()?[0].into()),
            9 => Value::Int(i8::from_ne_bytes(self.bytes::<1>()?).into()),
            other => return Err(self.corrupt(format!("unknown value type {other}"))),
        })
    }

    fn group(&mut self, depth: usize) -> Result<Group> {
        if depth > MAX_DEPTH {
            return Err(self.corrupt(format!("groups nest deeper than {MAX_DEPTH}")));
        }
        let _sorted_open = self.bytes::<2>()?;
        let n = self.len_field()?;
        let mut g = Group::default();
        for _ in 0..n {
            self.tags += 1;
            if self.tags > MAX_TAGS {
                return Err(self.corrupt(format!("more than {MAX_TAGS} tags")));
            }
            let [id] = self.bytes::<1>()?;
            let name_len = u16::from_be_bytes(self.bytes::<2>()?);
            let mut name = vec![0u8; usize::from(name_len)];
            if self.pos + u64::from(name_len) > self.len {
                return Err(self.corrupt("a tag name runs past the end of the file (truncated?)"));
            }
            self.f
                .read_exact(&mut name)
                .map_err(|e| Error::io(OP, self.path, &e))?;
            self.pos += u64::from(name_len);
            let name = String::from_utf8_lossy(&name).into_owned();
            if self.v4 {
                let _tag_length = self.bytes::<8>()?;
            }
            let node = match id {
                20 => Node::Group(self.group(depth + 1)?),
                21 => Node::Data(self.data()?),
                other => {
                    return Err(self.corrupt(format!(
                        "tag \"{name}\" has id {other} (20 = group, 21 = data)"
                    )))
                }
            };
            g.entries.push((name, node));
        }
        Ok(g)
    }

    /// A data tag after its name: `"%%%%"`, the info array, the value.
    fn data(&mut self) -> Result<Value> {
        if &self.bytes::<4>()? != b"%%%%" {
            return Err(self.corrupt("a data tag without its \"%%%%\" delimiter"));
        }
        let n = self.len_field()?;
        if n == 0 || n > MAX_INFO {
            return Err(self.corrupt(format!("an info array of {n} entries")));
        }
        let mut info = Vec::with_capacity(n as usize);
        for _ in 0..n {
            info.push(self.len_field()?);
        }
        match info[..] {
            [code] => self.simple(code),
            // A string: its length in bytes (as the readers in use treat it).
            [18, len] => self.skip(len).map(|()| Value::Other),
            [20, elem, count] => self.array(elem, count),
            [15, ..] => {
                let size = self.struct_size(&info[1..])?;
                self.skip(size).map(|()| Value::Other)
            }
            [20, 15, ..] => {
                let (def, count) = info[2..].split_at(info.len() - 3);
                let size = self.struct_size(def)?;
                self.skip_many(size, count[0])
            }
            [20, 20, elem, len, count] => {
                let size = simple_size(elem)
                    .and_then(|s| s.checked_mul(len))
                    .ok_or_else(|| self.corrupt("an array of arrays of an unknown type"))?;
                self.skip_many(size, count)
            }
            [20, 18, len, count] => self.skip_many(len, count),
            _ => Err(self.corrupt(format!("an info array {info:?} of no known layout"))),
        }
    }

    fn skip_many(&mut self, size: u64, count: u64) -> Result<Value> {
        let total = size
            .checked_mul(count)
            .ok_or_else(|| self.corrupt("an array size past 2^64"))?;
        self.skip(total).map(|()| Value::Other)
    }

    /// Bytes of a struct from its definition `name_len, n_fields, (name_len, type) × n`.
    fn struct_size(&self, def: &[u64]) -> Result<u64> {
        let n = *def
            .get(1)
            .ok_or_else(|| self.corrupt("a struct without its field count"))?;
        let fields = def.get(2..).unwrap_or(&[]);
        if fields.len() as u64 != n.saturating_mul(2) {
            return Err(self.corrupt(format!(
                "a struct of {n} fields described by {} entries",
                fields.len()
            )));
        }
        fields.chunks(2).try_fold(0u64, |acc, f| {
            simple_size(f[1])
                .map(|s| acc + s)
                .ok_or_else(|| self.corrupt(format!("a struct field of type {}", f[1])))
        })
    }

    fn array(&mut self, elem: u64, count: u64) -> Result<Value> {
        let size = simple_size(elem)
            .ok_or_else(|| self.corrupt(format!("an array of value type {elem}")))?;
        let total = size
            .checked_mul(count)
            .ok_or_else(|| self.corrupt("an array size past 2^64"))?;
        let offset = self.pos;
        let text = if count <= SMALL_ARRAY && matches!(elem, 4 | 10) {
            let mut text = String::new();
            for _ in 0..count {
                if let Value::Int(c) = self.simple(elem)? {
                    text.push(char::from_u32(c as u32).unwrap_or('\u{fffd}'));
                }
            }
            Some(text)
        } else {
            self.skip(total)?;
            None
        };
        Ok(Value::Array {
            offset,
            count,
            elem,
            text,
        })
    }
}

/// The element type of an image: the source dtype, the conversion and the stored bytes per
/// value, from `ImageData/DataType` (`code`) and the value type of `ImageData/Data` (`array`).
///
/// Unsigned integers load as they are; signed integers as the unsigned counts of their width
/// (a negative value is a decode error naming the frame); float32 and float64 through
/// `float_scale` (docs/formats.md §7.4); 64-bit integers — no DataType code for them is known
/// to the readers we checked, so they are recognised by the array's value type (11 i64,
/// 12 u64) under any DataType code not listed here — as `u32` counts (a value that does not fit
/// is a decode error). Complex, RGB and binary images are not counts and are refused by name.
fn image_dtype(code: i64, array: u64, little: bool, path: &Path) -> Result<(DType, ElemConv, u64)> {
    let big_endian = !little;
    let swap = |n: usize| {
        if big_endian {
            ElemConv::Swap(n)
        } else {
            ElemConv::Same
        }
    };
    let signed = |size| ElemConv::Signed { size, big_endian };
    let float = |wide: bool| {
        let scale = 1.0;
        if wide {
            ElemConv::Float64 { scale, big_endian }
        } else {
            ElemConv::Float32 { scale, big_endian }
        }
    };
    Ok(match (code, array) {
        (6, _) => (DType::U8, ElemConv::Same, 1),
        (10, _) => (DType::U16, swap(2), 2),
        (11, _) => (DType::U32, swap(4), 4),
        (9, _) => (DType::U8, signed(1), 1),
        (1, _) => (DType::U16, signed(2), 2),
        (7, _) => (DType::U32, signed(4), 4),
        (2, _) => (DType::U32, float(false), 4),
        (12, _) => (DType::U32, float(true), 8),
        (_, 11 | 12) if !matches!(code, 3 | 4 | 5 | 8 | 13 | 14 | 23 | 27 | 28) => (
            DType::U32,
            ElemConv::Int64 {
                signed: array == 11,
                big_endian,
            },
            8,
        ),
        _ => {
            let name = match code {
                3 | 5 | 13 | 27 | 28 => "complex",
                8 | 23 => "RGB",
                14 => "binary",
                _ => "an unknown type",
            };
            return Err(Error::source(OP, "unsupported Gatan image data type")
                .with_file(path)
                .with_expected(
                    "uint8 (6), uint16 (10), uint32 (11), int8 (9), int16 (1), int32 (7), \
                     float32 (2) or float64 (12) with float_scale, or 64-bit integers",
                )
                .with_found(format!("DataType {code} ({name})")));
        }
    })
}

/// One image of `ImageList`: its dimensions (fastest first), data type and data array.
struct Image<'g> {
    index: usize,
    dims: Vec<u64>,
    data_type: i64,
    /// `ImageData/Data` when it is an array of one simple type: offset, count, value type
    /// (complex images hold arrays of structs).
    data: Option<(u64, u64, u64)>,
    group: &'g Group,
}

fn images<'g>(root: &'g Group, path: &Path) -> Result<Vec<Image<'g>>> {
    let thumbs: Vec<i64> = root
        .group("Thumbnails")
        .map(|t| t.groups().filter_map(|g| g.int("ImageIndex")).collect())
        .unwrap_or_default();
    let list = root.group("ImageList").ok_or_else(|| {
        Error::source(OP, "Gatan DM file has no ImageList")
            .with_file(path)
            .with_expected("an ImageList group holding the images")
            .with_found("none")
    })?;
    let mut out = Vec::new();
    for (index, g) in list.groups().enumerate() {
        if thumbs.contains(&(index as i64)) {
            continue;
        }
        let Some(data) = g.group("ImageData") else {
            continue;
        };
        let dims: Vec<u64> = data
            .group("Dimensions")
            .map(|d| {
                d.values()
                    .filter_map(|v| match v {
                        Value::Int(i) => u64::try_from(*i).ok(),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let (Some(data_type), Some(array)) = (data.int("DataType"), data.value("Data")) else {
            continue;
        };
        let data = match array {
            Value::Array {
                offset,
                count,
                elem,
                ..
            } => Some((*offset, *count, *elem)),
            _ => None,
        };
        out.push(Image {
            index,
            dims,
            data_type,
            data,
            group: g,
        });
    }
    Ok(out)
}

/// `(scale, units)` of each calibrated dimension, fastest first.
fn calibrations(image: &Group) -> Vec<(f64, String)> {
    image
        .group("ImageData")
        .and_then(|d| d.group("Calibrations"))
        .and_then(|c| c.group("Dimension"))
        .map(|d| {
            d.groups()
                .map(|g| {
                    (
                        g.float("Scale").unwrap_or(1.0),
                        g.text("Units").unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A scan step in Å from a DM length unit.
fn to_angstrom(scale: f64, unit: &str) -> Option<f64> {
    let f = match unit.trim() {
        "nm" => 10.0,
        "Å" | "A" | "Angstrom" | "angstrom" => 1.0,
        "pm" => 0.01,
        "µm" | "um" => 1e4,
        _ => return None,
    };
    (scale.is_finite() && scale > 0.0).then_some(scale * f)
}

/// What the calibrations and microscope tags say, into `metadata`.
fn calibrate(root: &Group, image: &Image, version: u32, metadata: &mut Metadata) {
    let cal = calibrations(image.group);
    let mrad = |i: usize| {
        cal.get(i)
            .filter(|(s, u)| u.trim() == "mrad" && s.is_finite() && *s > 0.0)
            .map(|(s, _)| *s)
    };
    if let (Some(r), Some(c)) = (mrad(1), mrad(0)) {
        metadata.angular_sampling_mrad = Some((r, c));
    }
    if image.dims.len() == 4 {
        let step = |i: usize| cal.get(i).and_then(|(s, u)| to_angstrom(*s, u));
        if let (Some(r), Some(c)) = (step(3), step(2)) {
            metadata.scan_step_a = Some((r, c));
        }
    }
    let voltage = image
        .group
        .group("ImageTags")
        .or_else(|| root.group("ImageTags"))
        .and_then(|t| t.group("Microscope Info"))
        .and_then(|m| m.float("Voltage"));
    if let Some(v) = voltage.filter(|v| v.is_finite() && *v > 0.0) {
        metadata.energy_ev = Some(v);
    }
    metadata.extra.insert(
        "gatan_dm".into(),
        serde_json::json!({
            "version": version,
            "image_index": image.index,
            "dimensions_fastest_first": image.dims,
            "data_type": image.data_type,
            "calibrations": cal
                .iter()
                .map(|(s, u)| serde_json::json!({"scale": s, "units": u}))
                .collect::<Vec<_>>(),
        }),
    );
}

/// Parse the header and the tag tree.
fn parse(path: &Path) -> Result<(Group, bool, u32)> {
    let file = guard::open_regular(OP, path, "Gatan DM file")?;
    let len = file.metadata().map_err(|e| Error::io(OP, path, &e))?.len();
    let mut p = Parser {
        f: BufReader::new(file),
        path,
        pos: 0,
        len,
        v4: false,
        little: true,
        tags: 0,
    };
    let version = u32::from_be_bytes(p.bytes::<4>()?);
    if !matches!(version, 3 | 4) {
        return Err(Error::source(OP, "not a Gatan DM file")
            .with_file(path)
            .with_expected("version 3 or 4 (big-endian) in the first 4 bytes")
            .with_found(format!("version {version}")));
    }
    p.v4 = version == 4;
    let _root_length = p.len_field()?;
    p.little = u32::from_be_bytes(p.bytes::<4>()?) == 1;
    let root = p.group(0)?;
    Ok((root, p.little, version))
}

/// Open a `.dm4`/`.dm3` 3-D or 4-D stack.
pub(crate) fn open(path: &Path, opts: &OpenOptions) -> Result<Source> {
    let (root, little, version) = parse(path)?;
    let all = images(&root, path)?;
    let Some(image) = all.iter().find(|i| matches!(i.dims.len(), 3 | 4)) else {
        let shapes: Vec<String> = all.iter().map(|i| format!("{:?}", i.dims)).collect();
        return Err(Error::source(OP, "Gatan DM file holds no 3-D or 4-D image")
            .with_file(path)
            .with_expected("an image with 3 (frames) or 4 (scan and detector) dimensions")
            .with_found(if shapes.is_empty() {
                "no images".to_string()
            } else {
                format!("images of dimensions (fastest first) {}", shapes.join(", "))
            }));
    };
    let (offset, count, elem_code) = image.data.unwrap_or((0, 0, 0));
    let (dtype, elem, stored_size) = image_dtype(image.data_type, elem_code, little, path)?;
    let dims = &image.dims;
    let product = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    let stored_bytes = simple_size(elem_code).and_then(|s| s.checked_mul(count));
    if product != Some(count) || stored_bytes != product.and_then(|p| p.checked_mul(stored_size)) {
        return Err(Error::source(
            OP,
            "Gatan image data does not match its dimensions and type",
        )
        .with_file(path)
        .with_expected(format!(
            "{} values of {stored_size} bytes (dimensions {dims:?}, DataType {})",
            product.map_or("> 2^64".into(), |p| p.to_string()),
            image.data_type
        ))
        .with_found(format!(
            "an array of {count} values of type {elem_code} ({} bytes each)",
            simple_size(elem_code).unwrap_or(0)
        )));
    }
    // The products below are at most `count`, which fits the file.
    let us = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    let (k_c, k_r, n_frames, array_scan) = match dims[..] {
        [k_c, k_r, n] => (k_c, k_r, n, None),
        [k_c, k_r, c, r] => (k_c, k_r, r * c, Some(Shape2::new(us(r), us(c)))),
        _ => return Err(Error::internal(OP, "a DM image of 3 or 4 dimensions").with_file(path)),
    };
    let detector = Shape2::new(us(k_r), us(k_c));
    let frame_bytes = (k_r * k_c).saturating_mul(stored_size);
    if detector.is_empty() || n_frames == 0 {
        return Err(Error::source(OP, "Gatan image is empty")
            .with_file(path)
            .with_expected("every dimension > 0")
            .with_found(format!("dimensions (fastest first) {dims:?}")));
    }
    let mut metadata = Metadata::default();
    calibrate(&root, image, version, &mut metadata);
    build(
        path,
        opts,
        Found {
            kind: SourceKind::GatanDm,
            data_file: path.to_path_buf(),
            side_files: Vec::new(),
            dtype,
            detector,
            frames: Strided {
                first: offset,
                stride: frame_bytes,
                stored_frame_bytes: frame_bytes,
                n_frames,
            },
            array_scan,
            recorded_scan: None,
            elem,
            metadata,
        },
    )
}
