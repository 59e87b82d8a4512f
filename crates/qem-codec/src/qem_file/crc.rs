//! CRC-32C (Castagnoli) of the `.qem` container, from the `crc32c` crate (SSE4.2 / ARMv8 CRC
//! instructions where the CPU has them, tables elsewhere). [`Crc32c`] is the streaming form the
//! writer uses while sections go out.

/// A running CRC-32C: `update` with the bytes in order, then `finish`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Crc32c {
    /// The CRC of the bytes so far (finalised form; `crc32c_append` continues from it).
    value: u32,
}

impl Crc32c {
    /// The CRC of no bytes.
    pub fn new() -> Self {
        Crc32c::default()
    }

    /// Add `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        self.value = ::crc32c::crc32c_append(self.value, bytes);
    }

    /// The CRC-32C of everything added.
    pub fn finish(&self) -> u32 {
        self.value
    }
}

/// The CRC-32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    ::crc32c::crc32c(bytes)
}
