//! [`CountsModel`]: the static per-dataset model — construction and validation from parts,
//! [`CountsModel::fit`] over frames, the model byte layout ([`CountsModel::to_bytes`] /
//! [`CountsModel::from_bytes`]), accessors and the derived decode tables. Used by the encoder,
//! the decoders, the `.qem` writer/loader and the GPU engine.

use std::fmt;

use super::{
    check_dims, fit_contexts, fit_freq, fit_thresholds, frame_statistic, histogram_add,
    table_set_of, ContextFit, ModelParams, RansError, BUCKETS, LANES, MAX_CONTEXTS, MAX_LITERALS,
    MAX_TABLE_SETS, MODEL_HEADER_BYTES, MODEL_MAGIC, MODEL_MAGIC_V1, PROB_BITS, PROB_SCALE,
};

/// The static per-dataset model: context class per pixel, the frame-statistic rule (`split`,
/// `thresholds`) and `T·C` frequency rows.
///
/// Build with [`CountsModel::fit`] from data, [`CountsModel::from_parts`] (or
/// [`CountsModel::new`] for `T = 1`) from parts, or [`CountsModel::from_bytes`]. Also holds the
/// derived decode tables (not serialised).
#[derive(Clone, PartialEq, Eq)]
pub struct CountsModel {
    pub(super) literals: u8,
    pub(super) contexts: u8,
    pub(super) table_sets: u8,
    pub(super) split: u8,
    pub(super) ctx_map: Vec<u8>,
    pub(super) thresholds: Vec<u64>,
    /// `freq[(ts·C + c)·S + s]`.
    pub(super) freq: Vec<u16>,
    /// `cum[(ts·C + c)·S + s]`, exclusive prefix sums of each row.
    pub(super) cum: Vec<u16>,
    /// `lut[(ts·C + c)·4096 + slot]` = symbol.
    pub(super) lut: Vec<u8>,
}

impl fmt::Debug for CountsModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountsModel")
            .field("frame_len", &self.ctx_map.len())
            .field("literals", &self.literals)
            .field("contexts", &self.contexts)
            .field("table_sets", &self.table_sets)
            .field("split", &self.split)
            .field("thresholds", &self.thresholds)
            .finish_non_exhaustive()
    }
}

impl CountsModel {
    /// A one-table-set model (`T = 1`, `split = 0`, no thresholds) from its parts; see
    /// [`CountsModel::from_parts`].
    pub fn new(
        literals: u8,
        contexts: u8,
        ctx_map: Vec<u8>,
        freq: Vec<u16>,
    ) -> Result<CountsModel, RansError> {
        Self::from_parts(literals, contexts, 1, 0, ctx_map, Vec::new(), freq)
    }

    /// Build a model from its parts, with the same validation as [`CountsModel::from_bytes`]:
    /// `K`, `C`, `T` in range; `split ≤ C` and 0 when `T = 1`; `ctx_map` has one class `< C`
    /// per pixel (at least one pixel, at most `u32::MAX`); `T − 1` non-decreasing thresholds;
    /// `freq` is `T·C` rows of `K + 16` frequencies (layout `[T][C][S]`), each summing to 4096.
    pub fn from_parts(
        literals: u8,
        contexts: u8,
        table_sets: u8,
        split: u8,
        ctx_map: Vec<u8>,
        thresholds: Vec<u64>,
        freq: Vec<u16>,
    ) -> Result<CountsModel, RansError> {
        check_dims(literals, contexts, table_sets)?;
        if ctx_map.is_empty() || ctx_map.len() > u32::MAX as usize {
            return Err(RansError::BadParam {
                what: "frame_len",
                found: ctx_map.len() as u64,
                rule: "must be 1..=u32::MAX",
            });
        }
        Self::check_split(contexts, table_sets, split, 0)?;
        CountsModel {
            literals,
            contexts,
            table_sets,
            split,
            ctx_map,
            thresholds,
            freq,
            cum: Vec::new(),
            lut: Vec::new(),
        }
        .with_tables([0; 3])
    }

    /// `self`, whose dimensions and `split` are checked but whose decode tables are not yet
    /// derived (`cum` and `lut` empty), with [`CountsModel::check_parts`] passed against
    /// `offsets` and the tables derived: the last step of both constructors.
    fn with_tables(mut self, offsets: [usize; 3]) -> Result<CountsModel, RansError> {
        self.check_parts(offsets)?;
        let s = self.literals as usize + BUCKETS;
        let rows = self.table_sets as usize * self.contexts as usize;
        let m = PROB_SCALE as usize;
        let mut cum = vec![0u16; self.freq.len()];
        let mut lut = vec![0u8; rows * m];
        for r in 0..rows {
            let mut acc = 0usize;
            for sym in 0..s {
                cum[r * s + sym] = acc as u16;
                let f = self.freq[r * s + sym] as usize;
                lut[r * m + acc..r * m + acc + f].fill(sym as u8);
                acc += f;
            }
        }
        self.cum = cum;
        self.lut = lut;
        Ok(self)
    }

    fn check_split(contexts: u8, table_sets: u8, split: u8, at: usize) -> Result<(), RansError> {
        let limit = if table_sets == 1 { 0 } else { contexts };
        if split > limit {
            return Err(RansError::BadModel {
                what: "split (≤ C, 0 when T = 1)",
                offset: at,
                expected: limit.into(),
                found: split.into(),
            });
        }
        Ok(())
    }

    /// Validate classes, thresholds, sizes and row sums; `offsets` = byte offsets of
    /// `ctx_map`, `thresholds` and `freq` for serialised models (0 from parts).
    fn check_parts(&self, offsets: [usize; 3]) -> Result<(), RansError> {
        let (literals, contexts, table_sets) = (self.literals, self.contexts, self.table_sets);
        let (ctx_map, thresholds, freq) = (&self.ctx_map, &self.thresholds, &self.freq);
        let [ctx_offset, thr_offset, freq_offset] = offsets;
        let s = literals as usize + BUCKETS;
        if let Some(p) = ctx_map.iter().position(|&c| c >= contexts) {
            return Err(RansError::BadModel {
                what: "ctx_map class",
                offset: ctx_offset + p,
                expected: u64::from(contexts) - 1,
                found: ctx_map[p].into(),
            });
        }
        if thresholds.len() != table_sets as usize - 1 {
            return Err(RansError::BadModel {
                what: "thresholds (T - 1)",
                offset: thr_offset,
                expected: u64::from(table_sets) - 1,
                found: thresholds.len() as u64,
            });
        }
        if let Some(i) = thresholds.windows(2).position(|w| w[1] < w[0]) {
            return Err(RansError::BadModel {
                what: "thresholds non-decreasing",
                offset: thr_offset + 8 * (i + 1),
                expected: thresholds[i],
                found: thresholds[i + 1],
            });
        }
        let want = table_sets as usize * contexts as usize * s;
        if freq.len() != want {
            return Err(RansError::BadModel {
                what: "freq entries",
                offset: freq_offset,
                expected: want as u64,
                found: freq.len() as u64,
            });
        }
        for (r, row) in freq.chunks_exact(s).enumerate() {
            let sum: u64 = row.iter().map(|&f| u64::from(f)).sum();
            if sum != u64::from(PROB_SCALE) {
                return Err(RansError::BadModel {
                    what: "freq row sum",
                    offset: freq_offset + 2 * r * s,
                    expected: PROB_SCALE.into(),
                    found: sum,
                });
            }
        }
        Ok(())
    }

    /// Fit a model to `frames` (each exactly `frame_len` pixels) in the stages of the module
    /// doc: three passes over the frames (hence `Clone` on the iterator), the sampled ones
    /// only. Memory: `frame_len` sums and `T·C·(K + 16)` counts.
    pub fn fit<'a, I>(
        frames: I,
        frame_len: usize,
        params: &ModelParams,
    ) -> Result<CountsModel, RansError>
    where
        I: IntoIterator<Item = &'a [u16]>,
        I::IntoIter: Clone,
    {
        params.validate()?;
        if frame_len == 0 || frame_len > u32::MAX as usize {
            return Err(RansError::BadParam {
                what: "frame_len",
                found: frame_len as u64,
                rule: "must be 1..=u32::MAX",
            });
        }
        let frames = frames.into_iter();
        let every = params.sample_every;
        let sampled = || frames.clone().step_by(every);
        // Pass 1: per-pixel sums (every frame's length is checked).
        let mut sums = vec![0u64; frame_len];
        let mut n_sampled = 0u64;
        for (i, frame) in frames.clone().enumerate() {
            if frame.len() != frame_len {
                return Err(RansError::FrameLength {
                    what: "fit frame",
                    expected: frame_len,
                    found: frame.len(),
                });
            }
            if i % every != 0 {
                continue;
            }
            n_sampled += 1;
            for (s, &v) in sums.iter_mut().zip(frame) {
                *s += u64::from(v);
            }
        }
        if n_sampled == 0 {
            return Err(RansError::NoFrames);
        }
        let ContextFit { ctx_map, split } = fit_contexts(&sums, n_sampled, params)?;
        // Pass 2: frame statistics → thresholds.
        let stats: Vec<u64> = sampled()
            .map(|f| frame_statistic(&ctx_map, split, f))
            .collect();
        let thresholds = fit_thresholds(&stats, params.table_sets);
        // Pass 3: histograms per table set.
        let s = params.literals as usize + BUCKETS;
        let mut hist = vec![0u64; params.table_sets as usize * params.contexts as usize * s];
        for (f, &stat) in sampled().zip(&stats) {
            histogram_add(
                &mut hist,
                &ctx_map,
                table_set_of(&thresholds, stat),
                params.contexts,
                params.literals,
                f,
            );
        }
        let freq = fit_freq(
            &hist,
            params.table_sets,
            params.contexts,
            params.literals,
            params.floor,
        )?;
        Self::from_parts(
            params.literals,
            params.contexts,
            params.table_sets,
            split,
            ctx_map,
            thresholds,
            freq,
        )
    }

    /// Length of [`CountsModel::to_bytes`], without serialising.
    pub fn serialized_len(&self) -> usize {
        MODEL_HEADER_BYTES + self.ctx_map.len() + 8 * self.thresholds.len() + 2 * self.freq.len()
    }

    /// Serialise (layout in the module doc).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.serialized_len());
        out.extend_from_slice(&MODEL_MAGIC);
        out.extend_from_slice(&[
            PROB_BITS as u8,
            self.literals,
            BUCKETS as u8,
            self.contexts,
            LANES as u8,
            self.table_sets,
            self.split,
            0,
        ]);
        out.extend_from_slice(&(self.ctx_map.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.ctx_map);
        for q in &self.thresholds {
            out.extend_from_slice(&q.to_le_bytes());
        }
        for f in &self.freq {
            out.extend_from_slice(&f.to_le_bytes());
        }
        out
    }

    /// Parse and validate a serialised model (layout in the module doc): magic (v1 is
    /// rejected), fixed parameters, reserved byte, `K`/`C`/`T`/`split` ranges, exact length,
    /// classes `< C`, non-decreasing thresholds, row sums 4096.
    pub fn from_bytes(bytes: &[u8]) -> Result<CountsModel, RansError> {
        let bad = |what, offset, expected: u64, found: u64| RansError::BadModel {
            what,
            offset,
            expected,
            found,
        };
        if bytes.len() < MODEL_HEADER_BYTES {
            return Err(bad(
                "model length",
                0,
                MODEL_HEADER_BYTES as u64,
                bytes.len() as u64,
            ));
        }
        let magic = u64::from_le_bytes([
            bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7],
        ]);
        if bytes[..8] == MODEL_MAGIC_V1 {
            return Err(bad(
                "magic (format v1 model; v2 required)",
                0,
                u64::from_le_bytes(MODEL_MAGIC),
                magic,
            ));
        }
        if bytes[..8] != MODEL_MAGIC {
            return Err(bad("magic", 0, u64::from_le_bytes(MODEL_MAGIC), magic));
        }
        let checks: [(&'static str, usize, u8); 4] = [
            ("prob_bits", 8, PROB_BITS as u8),
            ("NB", 10, BUCKETS as u8),
            ("lanes", 12, LANES as u8),
            ("reserved", 15, 0),
        ];
        for (what, at, want) in checks {
            if bytes[at] != want {
                return Err(bad(what, at, want.into(), bytes[at].into()));
            }
        }
        let (literals, contexts, table_sets, split) = (bytes[9], bytes[11], bytes[13], bytes[14]);
        if literals == 0 || literals as usize > MAX_LITERALS {
            return Err(bad("K", 9, MAX_LITERALS as u64, literals.into()));
        }
        if contexts == 0 || contexts as usize > MAX_CONTEXTS {
            return Err(bad("C", 11, MAX_CONTEXTS as u64, contexts.into()));
        }
        if table_sets == 0 || table_sets as usize > MAX_TABLE_SETS {
            return Err(bad("T", 13, MAX_TABLE_SETS as u64, table_sets.into()));
        }
        Self::check_split(contexts, table_sets, split, 14)?;
        let frame_len = u32::from_le_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]) as usize;
        if frame_len == 0 {
            return Err(bad("frame_len", 16, 1, 0));
        }
        let s = literals as usize + BUCKETS;
        let thr_offset = MODEL_HEADER_BYTES + frame_len;
        let freq_offset = thr_offset + 8 * (table_sets as usize - 1);
        let total = freq_offset as u64 + 2 * u64::from(table_sets) * u64::from(contexts) * s as u64;
        if bytes.len() as u64 != total {
            return Err(bad("model length", 0, total, bytes.len() as u64));
        }
        CountsModel {
            literals,
            contexts,
            table_sets,
            split,
            ctx_map: bytes[MODEL_HEADER_BYTES..thr_offset].to_vec(),
            thresholds: bytes[thr_offset..freq_offset]
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                .collect(),
            freq: bytes[freq_offset..]
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
            cum: Vec::new(),
            lut: Vec::new(),
        }
        .with_tables([MODEL_HEADER_BYTES, thr_offset, freq_offset])
    }

    /// Pixels per frame.
    pub fn frame_len(&self) -> usize {
        self.ctx_map.len()
    }

    /// Literal symbols `K`.
    pub fn literals(&self) -> u8 {
        self.literals
    }

    /// Context classes `C`.
    pub fn contexts(&self) -> u8 {
        self.contexts
    }

    /// Table sets `T`.
    pub fn table_sets(&self) -> u8 {
        self.table_sets
    }

    /// Classes `< split` make the frame statistic.
    pub fn split(&self) -> u8 {
        self.split
    }

    /// The `T − 1` non-decreasing thresholds of the frame statistic.
    pub fn thresholds(&self) -> &[u64] {
        &self.thresholds
    }

    /// Symbols per row, `K + 16`.
    pub fn symbols(&self) -> usize {
        self.literals as usize + BUCKETS
    }

    /// Context class per pixel, raster order.
    pub fn ctx_map(&self) -> &[u8] {
        &self.ctx_map
    }

    /// All frequencies, layout `[T][C][S]` (row `(ts·C + c)` at `(ts·C + c)·S`).
    pub fn freq(&self) -> &[u16] {
        &self.freq
    }

    /// Frequency row of class `c` in table set 0; empty if `c ≥ C`.
    pub fn freq_row(&self, c: usize) -> &[u16] {
        if c >= self.contexts as usize {
            return &[];
        }
        self.freq_row_of(0, c)
    }

    /// Frequency row of class `c` in table set `ts` (`K + 16` entries summing to 4096); empty
    /// if out of range.
    pub fn freq_row_of(&self, ts: usize, c: usize) -> &[u16] {
        let s = self.symbols();
        if ts >= self.table_sets as usize || c >= self.contexts as usize {
            return &[];
        }
        let r = ts * self.contexts as usize + c;
        &self.freq[r * s..(r + 1) * s]
    }

    /// The frame statistic of `frame` under this model ([`frame_statistic`]).
    pub fn statistic(&self, frame: &[u16]) -> u64 {
        frame_statistic(&self.ctx_map, self.split, frame)
    }

    /// The table set `frame` is coded with.
    pub fn table_set_for(&self, frame: &[u16]) -> u8 {
        table_set_of(&self.thresholds, self.statistic(frame))
    }

    /// Largest value the symbol alphabet reaches: `K − 1 + 2^16 − 1` (≥ 65535). Whether a value
    /// is codable at a pixel also needs its symbol's frequency there to be non-zero.
    pub fn max_value(&self) -> u32 {
        u32::from(self.literals) + (1 << BUCKETS) - 2
    }
}
